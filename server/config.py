"""What the HTTP server sets beyond the engine, as one checked record: ``ServerConfig``."""

from __future__ import annotations

import msgspec

from engine.api import MAX_PIN_TTL_S

MAX_BODY_BYTES = 4 << 20
MAX_CHOICES = 256
# The names a loopback-bound server answers to by default (``serve``; any port).
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The API's model names, its key, and the limits it answers 4xx/5xx by."""

    model_name: str = "SmolLM2-135M-Instruct"
    extra_model_names: list[str] = []
    api_key: str | None = None
    # Requests waiting for admission beyond which new ones get 503 + Retry-After (None: no
    # limit, as vLLM).
    max_queued: int | None = None
    # Bodies over this many bytes get 413 before they are parsed (OpenAI's own limit is
    # larger, but no prompt that fits this model's context comes near it).
    max_body_bytes: int = MAX_BODY_BYTES
    # Engine requests (prompts x n) one HTTP request may add: 400 beyond it.
    max_choices: int = MAX_CHOICES
    # One INFO line per request on ``radixkv.access`` (method, path, status, time, tokens;
    # never the body): a client's 4xx leave a trace. ``serve --log-requests off`` drops it.
    log_requests: bool = True
    # The cache inspector (/inspect, /inspect/state) answers loopback clients only unless
    # this is set (``serve --inspect-public``): it shows what the cache holds.
    inspect_public: bool = False
    # The ``Host`` names requests must carry (any port; case-insensitive; "*": any), else 421:
    # a page on another site whose name was made to resolve to this server (DNS rebinding)
    # names its own. None: no check (an app mounted elsewhere; ``serve`` on a public
    # address). ``serve`` on loopback defaults to ``LOOPBACK_HOSTS``; ``--allowed-hosts``.
    allowed_hosts: list[str] | None = None
    # /v1/responses: where stored responses live (None: ~/.cache/radixkv/responses.sqlite3;
    # ":memory:" keeps them until the process ends), how many and how many bytes at most,
    # and how long a stored conversation's tokens stay pinned in the KV pool (0: not pinned).
    response_store: str | None = None
    response_store_max: int = 100_000
    response_store_bytes: int = 1 << 30
    response_ttl: float = 300.0

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model_name: must not be empty")
        if self.allowed_hosts is not None:
            hosts = self.allowed_hosts
            if not isinstance(hosts, list) or not hosts or not all(
                isinstance(h, str) and h.strip("[]") for h in hosts
            ):
                raise ValueError(
                    f"allowed_hosts: must be a non-empty list of host names, got {hosts!r}"
                )
            # As compared: lower case, an IPv6 address without its brackets.
            msgspec.structs.force_setattr(
                self, "allowed_hosts", [h.strip().strip("[]").lower() for h in hosts]
            )
        ttl = self.response_ttl
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not (
            0 <= ttl <= MAX_PIN_TTL_S
        ):
            raise ValueError(
                f"response_ttl: must be a number of seconds in [0, {MAX_PIN_TTL_S:.0f}] "
                f"(30 days), got {ttl!r}"
            )
        for name in ("max_queued", "max_body_bytes", "max_choices", "response_store_max",
                     "response_store_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: must be an int >= 1, got {value!r}")

    @property
    def names(self) -> list[str]:
        """Every name the API answers to, the main one first."""
        return [self.model_name, *self.extra_model_names]
