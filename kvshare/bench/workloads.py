"""Built-in workloads made from real English text, shared by benchmarks and tests."""
from __future__ import annotations

import random

# Public-domain English prose (Moby-Dick, ch. 1; Pride and Prejudice, ch. 1) used to build
# prompts of real text at any length.
ENGLISH_TEXT = (
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my "
    "purse, and nothing particular to interest me on shore, I thought I would sail about a little and "
    "see the watery part of the world. It is a way I have of driving off the spleen and regulating the "
    "circulation. Whenever I find myself growing grim about the mouth; whenever it is a damp, drizzly "
    "November in my soul; whenever I find myself involuntarily pausing before coffin warehouses, and "
    "bringing up the rear of every funeral I meet; and especially whenever my hypos get such an upper "
    "hand of me, that it requires a strong moral principle to prevent me from deliberately stepping "
    "into the street, and methodically knocking people's hats off, then, I account it high time to get "
    "to sea as soon as I can. This is my substitute for pistol and ball. With a philosophical flourish "
    "Cato throws himself upon his sword; I quietly take to the ship. There is nothing surprising in "
    "this. If they but knew it, almost all men in their degree, some time or other, cherish very nearly "
    "the same feelings towards the ocean with me. There now is your insular city of the Manhattoes, "
    "belted round by wharves as Indian isles by coral reefs; commerce surrounds it with her surf. Right "
    "and left, the streets take you waterward. Its extreme downtown is the battery, where that noble "
    "mole is washed by waves, and cooled by breezes, which a few hours previous were out of sight of "
    "land. Look at the crowds of water-gazers there. Circumambulate the city of a dreamy Sabbath "
    "afternoon. Go from Corlears Hook to Coenties Slip, and from thence, by Whitehall, northward. What "
    "do you see? Posted like silent sentinels all around the town, stand thousands upon thousands of "
    "mortal men fixed in ocean reveries. Some leaning against the spiles; some seated upon the "
    "pier-heads; some looking over the bulwarks of ships from China; some high aloft in the rigging, as "
    "if striving to get a still better seaward peep. But these are all landsmen; of week days pent up in "
    "lath and plaster, tied to counters, nailed to benches, clinched to desks. How then is this? Are the "
    "green fields gone? What do they here? "
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be "
    "in want of a wife. However little known the feelings or views of such a man may be on his first "
    "entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families, "
    "that he is considered the rightful property of some one or other of their daughters. My dear Mr. "
    "Bennet, said his lady to him one day, have you heard that Netherfield Park is let at last? Mr. "
    "Bennet replied that he had not. But it is, returned she; for Mrs. Long has just been here, and she "
    "told me all about it. Mr. Bennet made no answer. Do you not want to know who has taken it? cried "
    "his wife impatiently. You want to tell me, and I have no objection to hearing it. This was "
    "invitation enough. Why, my dear, you must know, Mrs. Long says that Netherfield is taken by a young "
    "man of large fortune from the north of England; that he came down on Monday in a chaise and four to "
    "see the place, and was so much delighted with it, that he agreed with Mr. Morris immediately; that "
    "he is to take possession before Michaelmas, and some of his servants are to be in the house by the "
    "end of next week. What is his name? Bingley. Is he married or single? Oh! Single, my dear, to be "
    "sure! A single man of large fortune; four or five thousand a year. What a fine thing for our girls! "
)



def token_prompts(encode, lengths: list[int], offset_step: int = 37) -> list[list[int]]:
    """Token-id prompts of exact lengths, cut from the real text at different offsets."""
    ids = encode(ENGLISH_TEXT)
    base = list(ids)
    while len(ids) < max(lengths) + 400:
        ids = ids + base
    return [ids[(i * offset_step) % 300:(i * offset_step) % 300 + n] for i, n in enumerate(lengths)]


def mixed_lengths(num: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int = 0):
    """(prompt_len, output_len) pairs drawn uniformly, reproducibly."""
    rng = random.Random(seed)
    return [(rng.randint(*prompt_range), rng.randint(*output_range)) for _ in range(num)]
