"""Section 2 -- bytes per token per head and capacity, from allocated tensors.

Every figure is ``nbytes`` of tensors actually allocated for ``S`` tokens, divided by
``S x heads`` (``PackedStore.nbytes`` asserts its own byte account at construction; the Tier A
witness is the fp16 tensor ``witcert.witness_of`` returns, and its one-byte e5m3 code, which
``witcert.monitor`` stores by default). Capacity is fp16 K+V bytes over the configuration's K+V bytes
(tokens served at the same memory). Paper: 1.88x without bypass, 1.68x with ``m = 4``. Each scheme's
capacity with the production monitor, value statistics and all: ``benchmarks/capacity.py``.
"""
import torch

import witcert

N_TOKENS, N_HEADS = 1024, 2  # a multiple of the 256-token block: per-block metadata is exact
PAPER = {"K+V token-group, m=0": 1.88, "K+V token-group, m=4 (fixed set)": 1.68}


def _keys(head_dim: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(N_HEADS, N_TOKENS, head_dim, generator=torch.Generator().manual_seed(seed))


def packed_bytes(head_dim: int, side: str, **kwargs) -> float:
    """Allocated bytes per token per head of one dithered-INT8 side (K or V)."""
    fixed = kwargs.pop("fixed", False)
    quantizer = witcert.DitheredInt8(**kwargs)
    x = _keys(head_dim)
    if fixed and quantizer.outlier_pairs:
        quantizer = quantizer.calibrate(x[:, :64])
    store = quantizer.quantize(x, witcert.tier_b.counters.StandaloneCounter(request=0, layer=0, side=side))
    return store.nbytes() / (N_HEADS * N_TOKENS)


def witness_bytes(head_dim: int, bands: int = 16, bits: int = 16) -> float:
    from witcert.tier_a.witness_code import WitnessCode

    layout = witcert.BandLayout(head_dim, bands)
    k = _keys(head_dim)
    w = WitnessCode(bits).witness(witcert.witness_of(k, witcert.get_scheme("rtn-int8")(k), layout))
    return w.numel() * w.element_size() / (N_HEADS * N_TOKENS)


def rows(head_dims=(64, 128)) -> list[dict]:
    out = []
    for d in head_dims:
        fp16 = 2 * d  # one side
        w = witness_bytes(d)
        k = {m: packed_bytes(d, "k", outlier_pairs=m, fixed=True) for m in (0, 2, 4, 8, 16)}
        k_energy4 = packed_bytes(d, "k", outlier_pairs=4)
        k_block = packed_bytes(d, "k", granularity="block-channel")
        v0 = packed_bytes(d, "v")
        configs = {
            "fp16 K+V (reference)": 2 * fp16,
            "Tier A witness alone (B=16)": w,
            "Tier A witness alone (B=16, one e5m3 byte per band)": witness_bytes(d, bits=8),
            "fp16 K+V + Tier A witness": 2 * fp16 + w,
            "K+V token-group, m=0": k[0] + v0,
            "K+V block-channel, m=0": k_block + packed_bytes(d, "v", granularity="block-channel"),
            **{f"K token-group m={m} (fixed set) + V m=0": k[m] + v0 for m in (2, 4, 8, 16)},
            "K token-group m=4 (per-block energy) + V m=0": k_energy4 + v0,
            "K+V token-group, m=4 (fixed set)": k[4] + packed_bytes(d, "v", outlier_pairs=4, fixed=True),
            "K+V token-group, m=0 + Tier A witness": k[0] + v0 + w,
        }
        for name, b in configs.items():
            capacity = None if name.startswith("Tier A witness alone") else 2 * fp16 / b
            out.append(dict(head_dim=d, config=name, bytes_per_token_per_head=b, capacity_vs_fp16=capacity,
                            paper_capacity=PAPER.get(name) if d == 128 else None))
    return out
