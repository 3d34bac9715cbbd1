"""The one place that turns EngineConfig's prefix-cache settings into tiers."""

from __future__ import annotations

from urllib.parse import urlsplit

from hybridmoe import tuning
from hybridmoe.engine.config import EngineConfig
from hybridmoe.engine.paged_kv import PagedKVCache
from hybridmoe.engine.prefix_cache.fingerprint import model_fingerprint
from hybridmoe.engine.prefix_cache.identity import namespace
from hybridmoe.engine.prefix_cache.tier import Tier
from hybridmoe.engine.prefix_cache.tiered_cache import TieredPrefixCache
from hybridmoe.errors import UserError
from hybridmoe.sizes import parse_size

DEFAULT_DISK = "10GB"
SCHEMES = ("mooncake", "redis", "rediss", "valkey")


def wants_tiers(config: EngineConfig) -> bool:
    return bool(config.prefix_cache_ram or config.prefix_cache_dir or config.prefix_cache_remote)


def chain_seed(model, block_size: int) -> bytes:
    """The namespace every block key of `model` starts from (identity.py)."""
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    return namespace(model_fingerprint(model), block_size, ",".join(dtypes))


def check_settings(config: EngineConfig) -> None:
    """A UserError for a prefix-cache setting that cannot work, before anything is loaded."""
    if config.prefix_cache_disk and not config.prefix_cache_dir:
        raise UserError("--prefix-cache-disk needs --prefix-cache-dir DIR: say where the blocks go")
    if config.prefix_cache_ram:
        parse_size(config.prefix_cache_ram, "--prefix-cache-ram")
    if config.prefix_cache_dir:
        parse_size(config.prefix_cache_disk or DEFAULT_DISK, "--prefix-cache-disk")
    url = config.prefix_cache_remote
    if url and urlsplit(url).scheme not in SCHEMES:
        raise UserError(
            f"--prefix-cache-remote {url}: give a mooncake://HOST:PORT or redis://HOST:PORT URL"
        )


def make_prefix_cache(config: EngineConfig, kv: PagedKVCache) -> TieredPrefixCache | None:
    """The tiers the config asks for (None: none, only the device pool's prefix cache)."""
    check_settings(config)
    if not wants_tiers(config):
        return None
    ram = None
    if config.prefix_cache_ram:
        from hybridmoe.engine.prefix_cache.ram_tier import RamTier

        ram = RamTier(parse_size(config.prefix_cache_ram, "--prefix-cache-ram"))
    persistent: list[Tier] = []
    if config.prefix_cache_dir:
        from hybridmoe.engine.prefix_cache.disk_tier import DiskTier

        size = parse_size(config.prefix_cache_disk or DEFAULT_DISK, "--prefix-cache-disk")
        persistent.append(DiskTier(config.prefix_cache_dir, size))
    if config.prefix_cache_remote:
        persistent.append(remote_tier(config.prefix_cache_remote, config.prefix_cache_timeout))
    return TieredPrefixCache(kv, ram, persistent, tuning.PREFIX_WRITE_QUEUE_BLOCKS)


def remote_tier(url: str, timeout: float) -> Tier:
    from hybridmoe.engine.prefix_cache.remote_tier import RemoteTier

    scheme = urlsplit(url).scheme
    if scheme == "mooncake":
        from hybridmoe.engine.prefix_cache.mooncake_store import MooncakeStore

        return RemoteTier(MooncakeStore(url), timeout, url)
    if scheme in ("redis", "rediss", "valkey"):
        from hybridmoe.engine.prefix_cache.redis_store import RedisStore

        return RemoteTier(
            RedisStore(url.replace("valkey://", "redis://", 1), timeout), timeout, url
        )
    raise UserError(
        f"--prefix-cache-remote {url}: give a mooncake://HOST:PORT or redis://HOST:PORT URL"
    )
