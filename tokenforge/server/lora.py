"""LoRA adapters over HTTP, as vLLM serves them: a request picks an adapter by its `model` field,
/v1/models lists each adapter with the base model as its `parent`, and (with
--allow-runtime-lora-updating) POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
/v1/unload_lora_adapter {"lora_name"} change the set at run time.

`LoRARegistry` holds the served names (name -> LoRARequest, ids from 1 up). A load reads and
checks the adapter in the engine core first, so a bad one is a 400 naming it and never becomes
servable; an unload removes the name at once (its next request is a 404, as for an unknown model)
and the core drops its host copy; requests already admitted finish with it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from tokenforge.messages import LoRARequest
from tokenforge.server.errors import APIError, bad_request

logger = logging.getLogger(__name__)


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_int_id: int | None = None


def adapter_not_found(name: str) -> APIError:
    return APIError(f"The model `{name}` does not exist.", status=404, param="lora_name", code="model_not_found")


def updating_disabled() -> APIError:
    return APIError("Loading and unloading LoRA adapters at run time is off: start the server with "
                    "--allow-runtime-lora-updating.", status=403, type="permission_error",
                    code="lora_updating_disabled")


class LoRARegistry:
    def __init__(self, engine, base_name: str) -> None:
        self.engine, self.base_name = engine, base_name
        self.adapters: dict[str, LoRARequest] = {}
        self.created: dict[str, int] = {}
        self.parents: dict[str, str] = {}    # --lora-modules' base_model_name, where one was given
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()          # one load or unload at a time: names stay unique

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)

    async def load(self, name: str, path: str, created: int = 0, parent: str | None = None) -> LoRARequest:
        """ValueError (naming the adapter) when it cannot be served or the name is taken."""
        async with self._lock:
            if name == self.base_name or name in self.adapters:
                raise ValueError(f"The LoRA adapter `{name}` has already been loaded"
                                 + (": it is the base model's name" if name == self.base_name else "."))
            lora = LoRARequest(name, next(self._ids), path)
            await self.engine.add_lora(lora)
            self.adapters[name], self.created[name] = lora, created
            if parent:
                self.parents[name] = parent
            logger.info("LoRA adapter %r loaded from %s", name, path)
            return lora

    async def unload(self, name: str) -> None:
        async with self._lock:
            if self.adapters.pop(name, None) is None:
                raise adapter_not_found(name)
            self.created.pop(name, None)
            self.parents.pop(name, None)
            await self.engine.remove_lora(name)
            logger.info("LoRA adapter %r unloaded", name)


def add_lora_routes(app: FastAPI, registry: LoRARegistry, allow_updating: bool, now) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRARequest) -> PlainTextResponse:
        if not allow_updating:
            raise updating_disabled()
        if not body.lora_name or not body.lora_path:       # vLLM's check and words
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.",
                              param="lora_name" if not body.lora_name else "lora_path")
        try:
            await registry.load(body.lora_name, body.lora_path, now())
        except ValueError as err:
            raise bad_request(str(err), param="lora_path" if "LoRA adapter '" in str(err) else "lora_name") from err
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRARequest) -> PlainTextResponse:
        if not allow_updating:
            raise updating_disabled()
        if not body.lora_name:
            raise bad_request("'lora_name' needs to be provided to unload a LoRA adapter.", param="lora_name")
        await registry.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def adapter_cards(registry: LoRARegistry | None, max_model_len: int) -> list[dict]:
    if registry is None:
        return []
    return [{"id": name, "object": "model", "created": registry.created.get(name, 0), "owned_by": "tokenforge",
             "root": lora.lora_path, "parent": registry.parents.get(name, registry.base_name), "max_model_len": max_model_len}
            for name, lora in registry.adapters.items()]


async def load_startup_adapters(registry: LoRARegistry, modules: dict[str, tuple[str, str | None]],
                                now: int) -> None:
    """--lora-modules: each is loaded before the server answers; ValueError for the first bad one."""
    for name, (path, parent) in modules.items():
        await registry.load(name, path, now, parent)
