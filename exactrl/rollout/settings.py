"""`rollout_backend`: where rollouts are generated (the in-process engine, OpenAI-compatible servers, Ray
engines) and how the trainer's weights reach them."""

from __future__ import annotations

from typing import Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, model_validator

from exactrl.argcheck import PathText
from exactrl.distributed.ray_engines import RayEngineSettings


class RolloutBackendSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    kind: Literal["engine", "openai", "ray"] = "engine"
    """`engine`: the in-process exactrl.Engine (bitwise exact); `openai`: an external OpenAI-compatible
    server (vLLM, SGLang, `exactrl serve`), whose mismatch is measured and corrected; `ray`: exactrl
    Engines as Ray actors, on this machine or a Ray cluster (bitwise exact; distributed/ray_engines.py)."""
    ray: RayEngineSettings = Field(default_factory=RayEngineSettings)
    """The engines of `kind: ray`: how many, where, with how many threads."""
    base_url: str | None = None
    """Server root, e.g. http://127.0.0.1:8000 (requests go to {base_url}/v1/completions)."""
    base_urls: list[str] = Field(default_factory=list)
    """More servers of the same model (roots, as `base_url`): requests are spread over all of them, each to
    the one with the fewest in flight; a `disk` weight sync loads every one."""
    model: str | None = None
    """Model name sent in every request: one the server serves (its /v1/models)."""
    api_key: str | None = Field(None, exclude=True)
    """Sent as `Authorization: Bearer KEY` with every request (`exactrl serve --api-key`). null: the first key
    of the environment variable EXACTRL_API_KEY, if set. Never written to the run's config.json or
    checkpoints (a resumed run needs it again): the variable keeps it out of config files too."""
    weight_sync: Literal["none", "disk"] = "none"
    """`none`: the server keeps its weights (data grows stale); `disk`: after each step the weights are
    saved to `sync_dir` and loaded by the server's /update_weights_from_disk."""
    sync_dir: PathText | None = None
    """Where `disk` writes checkpoints; the server must read the same path. None: a temp dir (same machine)."""
    timeout_s: float = Field(600.0, gt=0, le=1e9)
    """Per HTTP request (a whole completion of n samples, or one weight load); at most 1e9 s (about 30
    years: no limit in effect), as longer ones overflow the socket's timer."""
    max_concurrency: int = Field(16, ge=1)
    """Requests (one per prompt) in flight at once, per server."""

    @model_validator(mode="after")
    def _check(self) -> RolloutBackendSettings:
        if self.kind == "openai":
            if not self.base_url or not self.model:
                raise ValueError("rollout_backend.kind=openai needs rollout_backend.base_url and rollout_backend.model")
            named = [("base_url", self.base_url)] + [(f"base_urls[{i}]", u) for i, u in enumerate(self.base_urls)]
            for key, url in named:
                if not url.startswith(("http://", "https://")):
                    raise ValueError(
                        f"rollout_backend.{key} must be a server root such as http://host:8000, got {url!r}"
                    )
                if url.rstrip("/").endswith("/v1"):
                    raise ValueError(f"rollout_backend.{key} must be the server root, without /v1: got {url!r}")
                try:
                    host = httpx.URL(url).host
                except httpx.InvalidURL as e:
                    raise ValueError(f"rollout_backend.{key} is not a valid URL ({e}): got {url!r}") from None
                if not host:  # `http://` or `http://:8000`: every request failed as a connection error
                    raise ValueError(
                        f"rollout_backend.{key} names no host: it must be a server root such as "
                        f"http://host:8000, got {url!r}"
                    )
            roots = self.server_roots
            if len(set(roots)) != len(roots):
                raise ValueError(f"rollout_backend.base_url and base_urls name a server twice: {roots}")
        else:  # an external server's settings without kind=openai would be ignored without a word
            for key in ("base_url", "base_urls", "model", "api_key", "weight_sync", "sync_dir"):
                if getattr(self, key) != type(self).model_fields[key].get_default(call_default_factory=True):
                    raise ValueError(
                        f"rollout_backend.{key} needs rollout_backend.kind=openai (kind={self.kind} "
                        f"samples with exactrl engines)"
                    )
        if self.kind != "ray" and self.ray != RayEngineSettings():
            raise ValueError(f"rollout_backend.ray.* needs rollout_backend.kind=ray (kind is {self.kind})")
        return self

    @property
    def server_roots(self) -> list[str]:
        """Every server, `base_url` first, without trailing slashes."""
        return [u.rstrip("/") for u in [self.base_url or "", *self.base_urls]]
