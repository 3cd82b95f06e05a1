"""Batched token sampler with vLLM (v1) semantics.

Processing order for one decoding step, per row (same as vLLM v1):

0. Grammar: rows with a token bitmask (constrained decoding) have every disallowed token set
   to -inf first, so their logprobs, like vLLM's, are those of the constrained distribution.
1. Raw logprobs: if the row asked for ``logprobs`` (not None), its returned logprob / rank /
   top-k come from ``log_softmax`` of the *unprocessed* logits (vLLM's ``raw_logprobs`` mode).
2. ``min_tokens``: while ``len(output_token_ids) < min_tokens`` the row's ``eos_token_ids`` and
   ``stop_token_ids`` are masked to -inf (eos is masked even with ``ignore_eos``, as in vLLM; the
   engine may pass ``eos_token_ids=[]`` to avoid that).
3. Penalties: repetition (over prompt + output tokens: positive logits divided, non-positive
   multiplied), then frequency (``-= f * count_in_output``), then presence
   (``-= p * (count_in_output > 0)``).
4. Greedy rows (``temperature < 1e-5``) take the argmax of the logits after steps 2-3.
5. Random rows: divide by temperature, then min_p (drop tokens whose probability is below
   ``min_p * max_prob``), then top_k (keep logits >= the k-th largest; ties are kept), then top_p
   (on the renormalised top-k distribution keep the smallest head whose mass reaches ``top_p``),
   then sample with the exponential race ``argmax(probs / E)``, ``E ~ Exponential(1)``.

Seeded rows draw their ``E`` from their own ``torch.Generator`` over the full vocabulary, so a
seeded row's token does not depend on which other rows share the batch. Unseeded rows share one
draw from the default RNG.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from kvshare.sampling_params import SamplingParams

_SAMPLING_EPS = 1e-5
# Rows per chunk in logprobs_of: bounds the [rows, vocab] float32 temporaries (~256 x vocab).
_LOGPROBS_CHUNK_ROWS = 256


@dataclass
class SamplingRow:
    """One row of the batch: the request's params and the state the sampler needs."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: list[int] = field(default_factory=list)


@dataclass
class TokenBitmask:
    """Allowed tokens for some rows of a batch: `rows[i]`'s allowed ids are the set bits of
    `bits[i]` (bit j of int32 word w is token 32 * w + j), as grammar engines fill them."""

    rows: list[int]
    bits: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32

    def allowed(self, vocab: int) -> torch.Tensor:
        """[len(rows), vocab] bool."""
        as_bytes = self.bits.contiguous().numpy().view(np.uint8)
        unpacked = np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :vocab]
        return torch.from_numpy(unpacked).bool()


def apply_token_bitmask(logits: torch.Tensor, mask: TokenBitmask) -> torch.Tensor:
    """`logits` with each masked row's disallowed tokens at -inf (a new tensor; the input is kept).
    One torch.where pass over the masked rows: masked_fill_ with a bool mask is ~2x slower here."""
    allowed = mask.allowed(logits.shape[-1]).to(logits.device)
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    if mask.rows == list(range(logits.shape[0])):
        return torch.where(allowed, logits, neg_inf)
    idx = torch.tensor(mask.rows, dtype=torch.long, device=logits.device)
    out = logits.clone()
    out[idx] = torch.where(allowed, logits.index_select(0, idx), neg_inf)
    return out


@dataclass
class SampleResult:
    """Result for one row.

    ``logprob``/``rank`` are the raw-model logprob and 1-based rank (1 + number of tokens with a
    strictly greater logprob) of ``token_id``. They are only computed when the row asked for
    logprobs (``params.logprobs is not None``); otherwise ``logprob`` is NaN and ``rank`` is 0.
    ``top_ids``/``top_logprobs`` hold the top ``params.logprobs`` raw entries, best first.
    """

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


def _needs_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _min_tokens_ids(row: SamplingRow) -> list[int]:
    """Token ids to mask for this row this step (empty if min_tokens is satisfied)."""
    p = row.params
    if p.min_tokens <= 0 or len(row.output_token_ids) >= p.min_tokens:
        return []
    # (an id in both lists is set twice, harmlessly: no per-step deduplication)
    return [*row.eos_token_ids, *(p.stop_token_ids or [])]


def _pad_ids(lists: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max((len(x) for x in lists), default=0))
    out = torch.full((len(lists), width), pad, dtype=torch.long)
    for i, ids in enumerate(lists):
        if ids:
            out[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
    return out.to(device)


def _token_counts(lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(lists), vocab] float32 occurrence counts (ids >= vocab are ignored)."""
    ids = _pad_ids(lists, vocab, device).clamp_(max=vocab)
    counts = torch.zeros((len(lists), vocab + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Apply repetition/frequency/presence penalties in place to ``logits`` ([len(rows), V])."""
    vocab = logits.shape[-1]
    dev = logits.device
    out_counts = _token_counts([r.output_token_ids for r in rows], vocab, dev)
    out_mask = out_counts > 0
    rep = torch.tensor([r.params.repetition_penalty for r in rows], dtype=torch.float32, device=dev)
    if bool((rep != 1.0).any()):
        prompt_mask = _token_counts([r.prompt_token_ids for r in rows], vocab, dev) > 0
        seen = prompt_mask | out_mask
        rep_b = rep.unsqueeze(1).expand_as(logits)
        penalised = torch.where(logits > 0, logits / rep_b, logits * rep_b)
        logits = torch.where(seen, penalised, logits)
    freq = torch.tensor([r.params.frequency_penalty for r in rows], dtype=torch.float32, device=dev)
    pres = torch.tensor([r.params.presence_penalty for r in rows], dtype=torch.float32, device=dev)
    logits = logits - freq.unsqueeze(1) * out_counts
    logits = logits - pres.unsqueeze(1) * out_mask.to(torch.float32)
    return logits


class Sampler:
    """Samples one token per row; see the module docstring for the exact semantics."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 token_bitmask: TokenBitmask | None = None) -> list[SampleResult]:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}"
            )
        if not rows:
            return []
        raw = logits if logits.dtype == torch.float32 else logits.float()
        if token_bitmask is not None and token_bitmask.rows:
            raw = apply_token_bitmask(raw, token_bitmask)
        n, vocab = raw.shape
        dev = raw.device

        # ---- processed logits (only materialised when some row needs processing) ----
        mask_lists = [_min_tokens_ids(r) for r in rows]
        any_mask = any(mask_lists)
        pen_idx = [i for i, r in enumerate(rows) if _needs_penalties(r.params)]
        greedy = [r.params.temperature < _SAMPLING_EPS for r in rows]
        all_greedy = all(greedy)

        proc = raw
        if any_mask or pen_idx:
            proc = raw.clone()
            if any_mask:
                mrows = [i for i, m in enumerate(mask_lists) if m]
                midx = _pad_ids([mask_lists[i] for i in mrows], vocab, dev)
                # column `vocab` is a scratch column for padding / out-of-range ids
                buf = torch.zeros((len(mrows), vocab + 1), dtype=torch.bool, device=dev)
                buf.scatter_(1, midx.clamp_(max=vocab), True)
                ridx = torch.tensor(mrows, dtype=torch.long, device=dev)
                sub = proc.index_select(0, ridx).masked_fill_(buf[:, :vocab], float("-inf"))
                proc.index_copy_(0, ridx, sub)
            if pen_idx:
                pidx = torch.tensor(pen_idx, dtype=torch.long, device=dev)
                sub = apply_penalties(proc.index_select(0, pidx), [rows[i] for i in pen_idx])
                proc.index_copy_(0, pidx, sub)

        if all_greedy:
            chosen = proc.argmax(dim=-1)
        else:
            chosen = self._sample(proc, rows, greedy)

        return self._build_results(raw, chosen, rows)

    # ------------------------------------------------------------------ random sampling
    def _sample(
        self, proc: torch.Tensor, rows: list[SamplingRow], greedy: list[bool]
    ) -> torch.Tensor:
        n, vocab = proc.shape
        dev = proc.device
        rnd = [i for i, g in enumerate(greedy) if not g]
        chosen = torch.empty(n, dtype=torch.long, device=dev)
        if len(rnd) < n:
            gidx = [i for i, g in enumerate(greedy) if g]
            gi = torch.tensor(gidx, dtype=torch.long, device=dev)
            chosen[gi] = proc.index_select(0, gi).argmax(dim=-1)
        ri = torch.tensor(rnd, dtype=torch.long, device=dev)
        rrows = [rows[i] for i in rnd]
        x = proc.index_select(0, ri) if len(rnd) < n else proc  # never modified in place

        temps = torch.tensor([r.params.temperature for r in rrows], dtype=torch.float32, device=dev)
        if bool((temps != 1.0).any()):
            x = x / temps.unsqueeze(1)

        min_p = torch.tensor([r.params.min_p for r in rrows], dtype=torch.float32, device=dev)
        if bool((min_p > 0).any()):
            probs = torch.softmax(x, dim=-1)
            thresh = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
            x = x.masked_fill(probs < thresh, float("-inf"))

        ks = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rrows]
        use_k = any(k < vocab for k in ks)
        ps = [r.params.top_p for r in rrows]
        use_p = any(p < 1.0 for p in ps)
        if use_k and not use_p:
            kmax = max(k for k in ks if k < vocab)
            top_vals = x.topk(kmax, dim=-1).values  # sorted descending
            k_t = torch.tensor([min(k, kmax) for k in ks], dtype=torch.long, device=dev)
            kth = top_vals.gather(1, (k_t - 1).unsqueeze(1))
            disabled = torch.tensor([k >= vocab for k in ks], dtype=torch.bool, device=dev)
            kth = kth.masked_fill(disabled.unsqueeze(1), float("-inf"))
            x = x.masked_fill(x < kth, float("-inf"))
        elif use_p:
            if use_k and all(k < vocab for k in ks):
                # every row has a top-k: only the best max(k) logits can survive, no full sort
                sorted_x, order = x.topk(max(ks), dim=-1)
                base = torch.full_like(x, float("-inf"))
            else:
                sorted_x, order = x.sort(dim=-1, descending=True)
                base = torch.empty_like(x)
            if use_k:
                k_t = torch.tensor([min(k, sorted_x.shape[1]) for k in ks], dtype=torch.long, device=dev)
                kth = sorted_x.gather(1, (k_t - 1).unsqueeze(1))
                sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
            sp = torch.softmax(sorted_x, dim=-1)
            excl_cum = sp.cumsum(dim=-1) - sp  # mass strictly before each position
            p_t = torch.tensor(ps, dtype=torch.float32, device=dev)
            drop = excl_cum >= p_t.unsqueeze(1)
            drop[:, 0] = False  # always keep the best token
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
            x = base.scatter_(1, order, sorted_x)

        probs = torch.softmax(x, dim=-1)
        q = torch.empty_like(probs)
        unseeded = [j for j, r in enumerate(rrows) if r.generator is None]
        if unseeded:
            if len(unseeded) == len(rrows):
                q.exponential_()
            else:
                ui = torch.tensor(unseeded, dtype=torch.long, device=dev)
                q[ui] = torch.empty((len(unseeded), vocab), device=dev).exponential_()
        for j, r in enumerate(rrows):
            if r.generator is not None:
                q[j].exponential_(generator=r.generator)
        # an exact 0 would turn a masked (prob 0) token into 0/0 = NaN, which argmax would pick
        q.clamp_(min=torch.finfo(q.dtype).tiny)
        chosen[ri] = (probs / q).argmax(dim=-1)
        return chosen

    # ------------------------------------------------------------------ results
    @staticmethod
    def _build_results(
        raw: torch.Tensor, chosen: torch.Tensor, rows: list[SamplingRow]
    ) -> list[SampleResult]:
        ids = chosen.tolist()
        results = [SampleResult(token_id=t, logprob=float("nan"), rank=0) for t in ids]
        lp_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not lp_rows:
            return results
        if len(lp_rows) == len(rows):
            sub = raw
            sub_chosen = chosen
        else:
            li = torch.tensor(lp_rows, dtype=torch.long, device=raw.device)
            sub = raw.index_select(0, li)
            sub_chosen = chosen.index_select(0, li)
        ks = [rows[i].params.logprobs for i in lp_rows]
        for i, res in zip(lp_rows, _logprobs_rows(sub, sub_chosen, ks)):
            results[i].logprob = res.logprob
            results[i].rank = res.rank
            results[i].top_ids = res.top_ids
            results[i].top_logprobs = res.top_logprobs
        return results


def _logprobs_rows(
    logits: torch.Tensor, token_ids: torch.Tensor, ks: Sequence[int]
) -> list[SampleResult]:
    """Vectorised raw logprob, rank and top-k for each row (k may differ per row)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    tok = token_ids.to(device=logp.device, dtype=torch.long).unsqueeze(1)
    chosen_lp = logp.gather(1, tok)
    ranks = (logp > chosen_lp).sum(dim=-1) + 1
    kmax = min(max(ks, default=0), logp.shape[-1])
    if kmax > 0:
        top = logp.topk(kmax, dim=-1)
        top_lp, top_id = top.values.tolist(), top.indices.tolist()
    else:
        top_lp = top_id = [[] for _ in ks]
    out = []
    for j, (t, lp, rk, k) in enumerate(
        zip(token_ids.tolist(), chosen_lp.squeeze(1).tolist(), ranks.tolist(), ks)
    ):
        out.append(
            SampleResult(
                token_id=t, logprob=lp, rank=rk, top_ids=top_id[j][:k], top_logprobs=top_lp[j][:k]
            )
        )
    return out


def logprobs_of(
    logits: torch.Tensor, token_ids: torch.Tensor | list[int], k: int
) -> list[SampleResult]:
    """Raw logprob and 1-based rank of ``token_ids[i]`` under ``logits[i]``, plus the top-``k``.

    Used for prompt_logprobs: ``logits`` is [rows, vocab] (any float dtype), ``token_ids`` has one
    id per row. Rows are processed in chunks of 256, each with a single log_softmax / gather /
    topk, so a whole prompt chunk costs a handful of tensor ops.
    """
    if not isinstance(token_ids, torch.Tensor):
        token_ids = torch.tensor(list(token_ids), dtype=torch.long)
    token_ids = token_ids.reshape(-1)
    if logits.dim() != 2 or logits.shape[0] != token_ids.shape[0]:
        raise ValueError(
            f"logits {tuple(logits.shape)} and token_ids ({token_ids.shape[0]}) do not match"
        )
    k = max(0, int(k or 0))
    out: list[SampleResult] = []
    for s in range(0, logits.shape[0], _LOGPROBS_CHUNK_ROWS):
        e = s + _LOGPROBS_CHUNK_ROWS
        chunk_ids = token_ids[s:e]
        out.extend(_logprobs_rows(logits[s:e], chunk_ids, [k] * chunk_ids.shape[0]))
    return out


__all__ = ["SamplingRow", "SampleResult", "Sampler", "TokenBitmask", "apply_penalties", "apply_token_bitmask",
           "logprobs_of"]
