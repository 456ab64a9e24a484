"""Canonical tiers: one vocabulary for every engine's ``medium`` strings.

docs/contract.md, "Tiers and media": ``GPU``, ``CPU``, ``STORAGE``, ``EXTERNAL``, ``UNKNOWN``,
mapped case-insensitively; an unknown medium maps to ``UNKNOWN``, never to GPU,
and the raw string is kept next to the tier in every record.
"""

from __future__ import annotations

#: The Avro enum ``kvstream.v1.Tier``, in schema order.
TIERS = ("GPU", "CPU", "STORAGE", "EXTERNAL", "UNKNOWN")

#: Upper-cased medium string -> canonical tier. Sources: vLLM 0.33 kv_events.py
#: (MEDIUM_GPU/CPU/STORAGE; the Mooncake store connector sends lower-case "cpu"),
#: SGLang 0.5.23 StorageMedium (GPU, CPU_PINNED, DISK, EXTERNAL), and the media of
#: earlier vLLM releases (FS and OBJ were folded into STORAGE by vLLM #48123).
MEDIUM_TO_TIER: dict[str, str] = {
    "GPU": "GPU",
    "CPU": "CPU",
    "CPU_PINNED": "CPU",
    "STORAGE": "STORAGE",
    "DISK": "STORAGE",
    "FS": "STORAGE",
    "OBJ": "STORAGE",
    "EXTERNAL": "EXTERNAL",
}


def tier_of(medium: str | None) -> str:
    """Map an engine's medium to its canonical tier.

    ``None`` means GPU: only the GPU block pool omits the medium (vLLM before the
    field existed; SGLang's default). Anything not in :data:`MEDIUM_TO_TIER` is
    ``UNKNOWN``.
    """
    if medium is None:
        return "GPU"
    return MEDIUM_TO_TIER.get(medium.upper(), "UNKNOWN")
