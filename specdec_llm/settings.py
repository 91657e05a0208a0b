"""One place for configuration: ``SPECDEC_*`` environment variables (pydantic-settings).

A variable that cannot be read is a ``SettingsError`` naming it, its value and what it takes
(one line; the CLI prints it and exits 2), never pydantic's ``ValidationError``."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal, get_args

import platformdirs
from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticUseDefault
from pydantic_settings import BaseSettings, SettingsConfigDict

from .errors import SpecDecError

APP = "specdec-llm"
Dtype = Literal["float32", "bfloat16", "float16"]  # a pair's dtype (pairs/loading.py maps each to torch's)
DTYPE_NAMES: tuple[str, ...] = get_args(Dtype)


class SettingsError(SpecDecError, ValueError):
    """A ``SPECDEC_*`` variable that cannot be read; the message names it and the fix."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_", extra="ignore")

    # Pairs
    config_file: Path = Path(platformdirs.user_config_dir(APP)) / "pairs.toml"
    cache_dir: Path = Path(platformdirs.user_cache_dir(APP))
    default_pair: str = "smollm2-135m-q4"  # the fastest built-in pair (README: figures)
    # overrides every pair's, e.g. "cuda:0"; the form engine/devices.DEVICE checks (the engine is
    # not imported here: it loads torch)
    device: str | None = Field(None, pattern=r"^(cpu|mps|cuda(:\d+)?)$")
    dtype: Dtype | None = None  # overrides every pair's dtype
    threads: int | None = Field(None, ge=1)  # torch intra-op threads (CPU)

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
    max_wait_ms: float = Field(20.0, ge=0, allow_inf_nan=False)
    # Leases: a worker renews the heartbeat of each row it runs every lease_heartbeat_s; a
    # running row without a heartbeat for lease_timeout_s lost its worker and is requeued.
    lease_heartbeat_s: float = Field(10.0, gt=0, allow_inf_nan=False)
    lease_timeout_s: float = Field(60.0, gt=0, allow_inf_nan=False)

    @field_validator("lease_timeout_s")
    @classmethod
    def _two_beats(cls, value: float, info: ValidationInfo) -> float:
        """At least two heartbeats: a shorter lease requeued a live worker's rows between its beats."""
        beat = info.data.get("lease_heartbeat_s")
        if beat is not None and value < 2 * beat:
            raise ValueError(
                f"a lease shorter than two heartbeats (SPECDEC_LEASE_HEARTBEAT_S={beat:g}) is lost between them"
            )
        return value

    @field_validator("cache_dir", "data_dir", mode="before")
    @classmethod
    def _empty_is_default(cls, value: object) -> object:
        if value == "":  # SPECDEC_CACHE_DIR= : the default folder, not the current one (Path(""))
            raise PydanticUseDefault()
        return value

    @field_validator("device", "dtype", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        return None if value == "" else value  # SPECDEC_DEVICE= : each pair's own, as before

    @field_validator("max_batch")
    @classmethod
    def _max_batch(cls, value: int | str) -> int | str:
        from .engine.types import parse_max_batch

        try:
            return parse_max_batch(value)
        except ValueError:
            raise ValueError("not a batch size") from None

    @property
    def effective_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.data_dir / 'specdec.db'}"


# what a variable takes, for its error (the others take any text)
TAKES = {
    "device": "cpu, cuda, cuda:N or mps, or unset it for each pair's own device",
    "dtype": "float32, bfloat16 or float16, or unset it for each pair's own dtype",
    "max_batch": "an integer >= 1, auto (the size with the most tokens/s, from measured costs) or auto:N (up to N)",
    "threads": "a whole number >= 1 (torch's CPU threads), or unset it for torch's default",
    "max_wait_ms": "a finite number of milliseconds >= 0",
    "lease_heartbeat_s": "a finite number of seconds > 0",
    "lease_timeout_s": "a number of seconds, at least twice SPECDEC_LEASE_HEARTBEAT_S",
}


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The settings (read once; ``reload_settings`` reads them again); a ``SettingsError``
    naming the first variable that cannot be read."""
    try:
        return Settings()
    except ValidationError as e:
        raise SettingsError(unreadable(e)) from None


def unreadable(error: ValidationError) -> str:
    """One line: the first variable pydantic refused, its value, why, and what it takes."""
    first = error.errors()[0]
    field = str(first["loc"][0]) if first["loc"] else "?"
    msg = first["msg"].removeprefix("Value error, ")  # (a validator's own ValueError)
    why = msg[0].lower() + msg[1:]
    more = error.error_count() - 1
    return f"SPECDEC_{field.upper()}={first.get('input')!r}: {why}; set it to {TAKES.get(field, 'a valid value')}" + (
        f" ({more} more SPECDEC_* variable{'s' if more > 1 else ''} refused too)" if more else ""
    )


def reload_settings() -> Settings:
    get_settings.cache_clear()
    return get_settings()
