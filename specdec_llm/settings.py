"""One place for configuration: ``SPECDEC_*`` environment variables (pydantic-settings)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import platformdirs
from pydantic_settings import BaseSettings, SettingsConfigDict

APP = "specdec-llm"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_", extra="ignore")

    # Pairs
    config_file: Path = Path(platformdirs.user_config_dir(APP)) / "pairs.toml"
    cache_dir: Path = Path(platformdirs.user_cache_dir(APP))
    default_pair: str = "smollm2-135m-q4"  # the fastest built-in pair (README: figures)
    device: str | None = None  # overrides every pair's device, e.g. "cuda:0"
    dtype: str | None = None  # overrides every pair's dtype, e.g. "bfloat16"
    threads: int | None = None  # torch intra-op threads (CPU)

    # Store and queue (used by the store / workers)
    data_dir: Path = Path(platformdirs.user_data_dir(APP))
    database_url: str | None = None  # default: SQLite file in data_dir
    broker_url: str | None = None
    result_backend: str | None = None
    # USD per device-hour for cost figures: "2.5" for every device, or "cuda=2.5,cpu=0.05"
    price_per_hour: str | None = None
    # Worker dynamic batching: up to max_batch requests decode as one batch (1 = one at a
    # time, prefork pool; "auto" = the size with the most tokens/s on this machine, from its
    # measured costs); an idle worker waits max_wait_ms for a burst to start together.
    max_batch: int | str = "auto"
    max_wait_ms: float = 20.0
    # Leases: a worker renews the heartbeat of each row it runs every lease_heartbeat_s; a
    # running row without a heartbeat for lease_timeout_s lost its worker and is requeued.
    lease_heartbeat_s: float = 10.0
    lease_timeout_s: float = 60.0

    @property
    def effective_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.data_dir / 'specdec.db'}"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()


def reload_settings() -> Settings:
    get_settings.cache_clear()
    return get_settings()
