"""API keys and the tenants they belong to (docs/security.md).

`--api-key KEY` (repeatable) and `--api-key-file FILE` give the keys. The file has one key per
line, `KEY TENANT` (two fields separated by spaces or tabs); blank lines and lines starting with
'#' are skipped. Several keys may share a tenant (key rotation). The keys of `--api-key` are the
tenants api-key-1, api-key-2, ... in the order given (a file line naming such a tenant adds a key
to it).

With `--cache-salt-from-api-key` the prefix cache salt of a request is derived from its key's
tenant and the client's own cache_salt (tenant_cache_salt): a client can still partition the
cache within its tenant, but never reach another tenant's blocks, and its `cached_tokens` then
says nothing about what other tenants sent. Requests of one tenant without a cache_salt share
that tenant's cache, as unsalted requests share the whole cache without the option.
"""
from __future__ import annotations

import json

from kvshare.server.settings import flag_key_tenant

API_KEY_ENV = "KVSHARE_API_KEY"
ADMIN_KEY_ENV = "KVSHARE_ADMIN_KEY"
# The keys a data-parallel front end hands its replicas (JSON), in the environment, not on the
# command line where `ps` shows it.
REPLICA_AUTH_ENV = "KVSHARE_REPLICA_AUTH"
# The ASGI scope entry where the gate (middleware.GuardMiddleware) leaves the tenant of the request's key.
TENANT_SCOPE_KEY = "kvshare.tenant"


def tenant_cache_salt(tenant: str, client_salt: str | None) -> str:
    """The salt the engine uses: the pair JSON-encoded, so no (tenant, salt) pair can spell
    another's (tenant "a" with salt "b:c" is not tenant "a:b" with salt "c")."""
    return json.dumps([tenant, client_salt], ensure_ascii=False, separators=(",", ":"))


def effective_cache_salt(config, scope, client_salt: str | None) -> str | None:
    """The cache salt of a request that passed the gate: the client's own, or with
    --cache-salt-from-api-key its key's tenant's (tenant_cache_salt). Computed the same way by a
    data-parallel front end (to route) and its replicas (to cache), which check the same keys."""
    if not config.cache_salt_from_api_key:
        return client_salt
    return tenant_cache_salt(scope[TENANT_SCOPE_KEY], client_salt)


def read_api_key_file(path: str) -> dict[str, str]:
    """key -> tenant from `path`. Errors name the file and line, never quote it (a line is a key)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-key-file {path}: cannot read it ({type(e).__name__})") from None
    keys: dict[str, str] = {}
    first_line: dict[str, int] = {}
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) != 2:
            raise ValueError(f"--api-key-file {path} line {number}: expected 'KEY TENANT' (two fields separated by "
                             f"spaces), got {len(fields)} field(s)")
        key, tenant = fields
        if key in keys:
            raise ValueError(f"--api-key-file {path} line {number}: the key of line {first_line[key]} again (each "
                             f"key belongs to one tenant)")
        keys[key] = tenant
        first_line[key] = number
    if not keys:
        raise ValueError(f"--api-key-file {path}: no keys in it (lines 'KEY TENANT')")
    return keys


def keys_from_args(flag_keys: list[str] | None, key_file: str | None, environ) -> dict[str, str]:
    """key -> tenant from --api-key (each its own tenant, api-key-N), else $KVSHARE_API_KEY, and
    --api-key-file. An empty key is an error naming where it came from: it must never turn
    authentication off."""
    if flag_keys is None and environ.get(API_KEY_ENV) is not None:
        if not environ[API_KEY_ENV]:
            raise ValueError(f"{API_KEY_ENV} is set but empty: set it to a key, or unset it to serve without one")
        flag_keys = [environ[API_KEY_ENV]]
    keys: dict[str, str] = {}
    for i, key in enumerate(flag_keys or (), 1):
        if not key:
            raise ValueError(f"--api-key number {i} is empty: give a non-empty key, or no --api-key to serve "
                             f"without one")
        if key in keys:
            raise ValueError(f"--api-key number {i} repeats an earlier --api-key")
        keys[key] = flag_key_tenant(i)
    if key_file is not None:
        for key, tenant in read_api_key_file(key_file).items():
            if key in keys:
                raise ValueError(f"--api-key-file {key_file}: a key in it is also given by --api-key")
            keys[key] = tenant
    return keys


def admin_key_from_args(flag_key: str | None, environ) -> str | None:
    if flag_key is None:
        flag_key = environ.get(ADMIN_KEY_ENV)
        if flag_key == "":
            raise ValueError(f"{ADMIN_KEY_ENV} is set but empty: set it to a key, or unset it")
    elif flag_key == "":
        raise ValueError("--admin-key is empty: give a non-empty key, or no --admin-key")
    return flag_key
