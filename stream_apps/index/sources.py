"""What routers and operators register about serving instances: :class:`SourceInfo` per instance, kept by a
:class:`SourceRegistry` (the fleet index's filter by model, tenant and block size, docs/querying.md). Registrations
reach every process through the compacted ``kv-instances`` topic (:mod:`stream_apps.index.registrations`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.engine_hashes import HashProfile

#: Tenant of an instance that registered none, and of a query that names none (Mooncake's default).
DEFAULT_TENANT = "default"
#: Tokens per block assumed for an instance that registered no block size (vLLM's default block size).
DEFAULT_BLOCK_SIZE = 16


@dataclass
class SourceInfo:
    """What a router or operator registered about one serving instance (``POST /register``, Mooncake's body)."""

    #: Serving instance, as its events name it (``kv_event.instance_id``).
    instance_id: str
    #: Model the instance serves (``modelname``); None: unknown, so it matches a query for any model.
    model_name: str | None = None
    #: Tokens per KV block of the instance; None: the index's default block size.
    block_size: int | None = None
    #: Tenant namespace (Mooncake's ``tenant_id``); queries of another tenant never see the instance.
    tenant_id: str = DEFAULT_TENANT
    #: The engine's KV event endpoint (``tcp://HOST:PORT``), as registered.
    endpoint: str | None = None
    #: The engine's replay endpoint (vLLM's ``replay_endpoint``), a kvstream field beside Mooncake's body.
    replay_endpoint: str | None = None
    #: Engine kind as registered (``vLLM``, ``SGLang``, ``Mooncake``).
    engine_type: str | None = None
    #: Data-parallel ranks registered.
    dp_ranks: set[int] = field(default_factory=set)
    #: LoRA adapter registered with the instance, if any.
    lora_name: str | None = None
    #: Mooncake's ``hash_profile`` dict as registered (how the engine hashes blocks), or None.
    hash_profile: dict | None = None
    #: Whether the engine's published hashes equal the ones its hash profile gives for the same tokens: None
    #: until a query by tokens matched the instance (or when the profile cannot be recomputed: a random seed);
    #: False means the instance is misconfigured (its profile, seed or block size is not what it runs with).
    hash_profile_ok: bool | None = None


class SourceRegistry:
    """Registered metadata per instance (:class:`SourceInfo`); an instance never registered has the defaults."""

    def __init__(self, default_block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        #: Tokens per block of an instance that registered none.
        self.default_block_size = default_block_size
        #: Bumped by every change of the registry: what a cached per-query filter checks it is still right for.
        self.version = 0
        self._sources: dict[str, SourceInfo] = {}

    def merged(self, info: SourceInfo) -> SourceInfo:
        """``info`` as :meth:`register` would record it: its data-parallel ranks joined to those already
        registered (``info`` itself is changed).

        Raises:
            ValueError: a ``hash_profile`` that :meth:`schemas.engine_hashes.HashProfile.parse` refuses.
        """
        if info.hash_profile is not None:
            try:
                HashProfile.parse(info.hash_profile)
            except (TypeError, ValueError) as exc:
                raise ValueError(str(exc) if "hash_profile" in str(exc) else f"hash_profile: {exc}") from None
        known = self._sources.get(info.instance_id)
        if known is not None:
            info.dp_ranks |= known.dp_ranks
        return info

    def register(self, info: SourceInfo) -> None:
        """Record (or update) an instance's metadata; data-parallel ranks accumulate.

        Raises:
            ValueError: a ``hash_profile`` that :meth:`schemas.engine_hashes.HashProfile.parse` refuses.
        """
        self.put(self.merged(info))

    def put(self, info: SourceInfo) -> None:
        """Make ``info`` the instance's registration as it is (a record of ``kv-instances``: ranks already
        merged). A hash profile check already made is kept while the profile stays the same."""
        known = self._sources.get(info.instance_id)
        if known is not None and known.hash_profile == info.hash_profile and info.hash_profile_ok is None:
            info.hash_profile_ok = known.hash_profile_ok
        self._sources[info.instance_id] = info
        self.version += 1

    def unregister(self, instance_id: str) -> bool:
        """Forget an instance's metadata; False if it had none."""
        self.version += 1
        return self._sources.pop(instance_id, None) is not None

    def get(self, instance_id: str) -> SourceInfo | None:
        """The registered metadata of ``instance_id``, or None."""
        return self._sources.get(instance_id)

    def all(self) -> list[SourceInfo]:
        """Every registered instance."""
        return list(self._sources.values())

    def __len__(self) -> int:
        return len(self._sources)

    def block_size(self, instance_id: str) -> int:
        """Tokens per block of ``instance_id``: registered, else the default."""
        info = self._sources.get(instance_id)
        return info.block_size if info is not None and info.block_size else self.default_block_size

    def matches(self, instance_id: str, model_name: str | None, tenant_id: str | None) -> bool:
        """Whether a query for ``model_name`` (None: any) of ``tenant_id`` (None: the default tenant) may name
        ``instance_id``: same tenant, and the same model unless either side names none."""
        info = self._sources.get(instance_id)
        tenant = tenant_id or DEFAULT_TENANT
        if info is None:
            return tenant == DEFAULT_TENANT
        if info.tenant_id != tenant:
            return False
        return model_name is None or info.model_name is None or info.model_name == model_name
