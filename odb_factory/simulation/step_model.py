"""Step-time model: turns one rank's micro-batch into seconds, and a step into the slowest rank.

Per rank and micro-batch (every term is documented with its source in bench/README.md):

    LLM     t = c0 + a * T + b * S2        T  = padded tokens (n * max_len) for padded batches,
              (+ head * H)
                                              real tokens (sum l) for packed ones
                                           S2 = n * max_len**2 (padded) or sum l**2 (packed);
                                              a sample of k rows of l/k tokens each (a dpo
                                              pair: k = 2) counts l**2 / k
                                           H  = positions whose logits are computed (every
                                              occupied one, or the supervised ones only); a
                                              separate term only in a measured model, the
                                              spec-derived one prices the LM head inside `a`
    vision  t = sum over images (v0 + va * P + vb * P**2)     P = patches of the image
    step    = max over ranks (LLM + vision) + gradient reduce-scatter      (every micro-step;
              the max over the ranks' sums per optimizer step where ranks meet only there, DDP)
            + parameter all-gather + optimizer update                     (every optimizer step)
    memory  = static (weights, ZeRO-2 shards, buffers) + T * bytes/token + patches * bytes/patch
              > HBM  ->  OOM (reported by the simulation, never silently counted)

Coefficients are derived from public specs (`ModelSpec`, `Hardware`) and one efficiency
number `mfu` (achieved fraction of peak dense BF16 FLOP/s on the big matmuls). The benchmark
(`bench/step_model.py`) fits the same form to measured rows; `python -m odb_factory.dry_run` prices
a recipe's batches with it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

GB = 1e9


@dataclass(frozen=True)
class ModelSpec:
    """Architecture numbers of one VLM (bench/README.md, "Step-time model", says where each comes from)."""
    name: str
    total_params: float          # all weights (bf16 copy on every rank)
    llm_params: float            # LLM weights incl. embeddings: trained in full FT
    llm_compute_params: float    # weights touched per token: non-embedding + lm_head
    llm_layers: int
    hidden: int
    attn_dim: int                # query heads * head_dim
    vocab: int
    vision_params: float
    vision_layers: int
    vision_width: int
    lora_params: float           # LoRA rank-8 adapters on every LLM linear layer


QWEN3_VL_8B = ModelSpec("Qwen3-VL-8B", total_params=8.77e9, llm_params=8.19e9,
                        llm_compute_params=6.95e9 + 0.62e9, llm_layers=36, hidden=4096,
                        attn_dim=4096, vocab=151936, vision_params=0.41e9, vision_layers=27,
                        vision_width=1152, lora_params=21.8e6)
QWEN3_VL_2B = ModelSpec("Qwen3-VL-2B", total_params=2.13e9, llm_params=1.72e9,
                        llm_compute_params=1.41e9 + 0.31e9, llm_layers=28, hidden=2048,
                        attn_dim=2048, vocab=151936, vision_params=0.30e9, vision_layers=24,
                        vision_width=1024, lora_params=8.7e6)
MODELS = {"8B": QWEN3_VL_8B, "2B": QWEN3_VL_2B}


@dataclass(frozen=True)
class Hardware:
    """One cluster shape. Bandwidths are achieved collective bus bandwidths (bytes/s)."""
    name: str
    nodes: int
    gpus_per_node: int = 8
    peak_flops: float = 148e12       # H20 dense BF16
    hbm_bytes: float = 96 * GB       # H20 HBM3
    hbm_bandwidth: float = 4.0e12    # H20 HBM3, bytes/s
    intra_busbw: float = 360 * GB    # NVLink 900 GB/s bidirectional = 450 GB/s per direction, x0.8
    inter_busbw: float = 80 * GB     # 4 x 200 Gb/s RoCE per node = 100 GB/s, x0.8

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def busbw(self) -> float:
        """A ring over several nodes runs at the slowest link: the nodes' NICs."""
        return self.intra_busbw if self.nodes == 1 else self.inter_busbw


H20_1NODE = Hardware("8xH20", nodes=1)
H20_2NODES = Hardware("2x8xH20", nodes=2)

# Efficiency of the big matmuls, the one number that is not a spec. Calibrated on the paper's
# Standard samples/s (UltraChat-200K and LLaVA-150K, 8B full FT; see bench/run.py and bench/README.md).
DEFAULT_MFU = 0.82
KERNEL_LAUNCH_S = 8e-6           # per kernel (launch + small-kernel tail), assumption
KERNELS_PER_LAYER_PASS = 20      # assumption: norms, 7 GEMMs, rope, attention, activations
FRAMEWORK_S = 0.015              # per micro-step: HF/DeepSpeed Python hooks, assumption
OPTIMIZER_FIXED_S = 0.010        # per optimizer step: grad-norm, scheduler, Python, assumption
FRAMEWORK_RESERVE = 5 * GB       # CUDA context, NCCL buffers, allocator fragmentation
ZERO_BUCKETS = 2 * GB            # LLaMA-Factory ds_z2: 5e8-element reduce + allgather buckets


@dataclass(frozen=True)
class StepModel:
    """All coefficients of the step-time model for one (model, mode, hardware)."""
    name: str
    world: int
    ranks_per_node: int
    c0: float                 # s per non-empty micro-batch (launch + framework)
    a: float                  # s per LLM token
    b: float                  # s per token**2 of attention (S2)
    v0: float                 # s per image
    va: float                 # s per patch
    vb: float                 # s per patch**2
    idle_s: float             # an IDLE slot still runs a tiny filler step
    comm_micro_s: float       # gradient reduce-scatter, every micro-step
    comm_opt_s: float         # parameter all-gather, every optimizer step
    optimizer_s: float        # optimizer update, every optimizer step
    hbm_bytes: float
    static_bytes: float
    bytes_per_token: float
    bytes_per_patch: float
    head: float = 0.0         # s per position whose logits are computed, when apart from `a`
    device: str = "gpu"       # what it prices: "gpu" (specs) or "cpu" (simulation.measured)
    # where the ranks wait for the slowest: at every micro-step (ZeRO reduces gradients after
    # each backward) or at the optimizer step only (DDP skips the reduction while accumulating)
    ranks_meet: str = "micro_step"

    def llm_seconds(self, tokens, sq):
        return self.c0 + self.a * np.asarray(tokens, dtype=np.float64) + self.b * np.asarray(sq, dtype=np.float64)

    def vision_seconds(self, images, patches, patch_sq):
        return (self.v0 * np.asarray(images, dtype=np.float64)
                + self.va * np.asarray(patches, dtype=np.float64)
                + self.vb * np.asarray(patch_sq, dtype=np.float64))

    def sample_seconds(self, length, patches=0, patch_sq=0, images=0):
        """One sample alone on a rank (no c0-sharing): the LB of any step that holds it."""
        l = np.asarray(length, dtype=np.float64)
        return self.llm_seconds(l, l * l) + self.vision_seconds(images, patches, patch_sq)

    def token_cost(self, length):
        """Per-sample LLM cost g(l) = a*l + b*l**2, non-decreasing: the balancer's unit."""
        l = np.asarray(length, dtype=np.float64)
        return self.a * l + self.b * l * l

    def memory_bytes(self, tokens, patches=0):
        return (self.static_bytes + self.bytes_per_token * np.asarray(tokens, dtype=np.float64)
                + self.bytes_per_patch * np.asarray(patches, dtype=np.float64))

    def fits(self, tokens, patches=0):
        return self.memory_bytes(tokens, patches) <= self.hbm_bytes

    @property
    def cap_tokens(self) -> int:
        """Most padded LLM tokens one micro-batch may hold (without vision patches)."""
        return int((self.hbm_bytes - self.static_bytes) // self.bytes_per_token)

    def safe_batch(self, longest_tokens: int, longest_patches: int = 0) -> int:
        """Largest fixed per-device batch whose worst case (every row as long as the longest
        sample) fits memory; 0 if even one such sample does not fit."""
        k = 0
        while self.fits((k + 1) * longest_tokens, (k + 1) * longest_patches) and k < 4096:
            k += 1
        return k

    def scaled(self, mfu_ratio: float) -> "StepModel":
        """The same model with compute terms divided by `mfu_ratio` (new MFU / old MFU)."""
        f = 1.0 / mfu_ratio
        return replace(self, a=self.a * f, b=self.b * f, head=self.head * f, va=self.va * f, vb=self.vb * f)


REFERENCE_MODELS = ("none", "shared", "copy")


def build_step_model(model: ModelSpec, hw: Hardware, mode: str = "full",
                     mfu: float = DEFAULT_MFU, gradient_checkpointing: bool = True,
                     overlap_comm: float = 0.0, reference_model: str = "none") -> StepModel:
    """Coefficients from specs.

    mode: "full" (every LLM weight trained; vision tower and merger frozen, LLaMA-Factory's
    default) or "lora" (rank-8 adapters; frozen base weights, so no weight gradients).
    mfu: achieved fraction of peak on the matmuls; higher = every compute term shrinks.
    gradient_checkpointing: LLaMA-Factory's default; adds a second forward (+1/3 compute for
    full FT) and divides activation memory per token by roughly the layer count.
    overlap_comm: fraction of the gradient reduce-scatter hidden behind backward (0: the
    LLaMA-Factory ds_z2 config sets overlap_comm false).
    reference_model: a preference loss's reference (stage dpo) runs one more forward, without
    gradients, over every micro-batch: "shared" is the trained model with its LoRA adapters
    off (LLaMA-Factory's LoRA default), "copy" a frozen bf16 copy of the weights besides (full
    and freeze fine-tuning), "none" no reference (every other stage, and the orpo/simpo losses).
    """
    if mode not in ("full", "lora"):
        raise ValueError(f"mode must be 'full' or 'lora', got {mode!r}")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu!r}")
    if reference_model not in REFERENCE_MODELS:
        raise ValueError(f"reference_model must be one of {list(REFERENCE_MODELS)}, got {reference_model!r}")
    ref = 0 if reference_model == "none" else 1
    rate = hw.peak_flops * mfu
    gc = 1 if gradient_checkpointing else 0
    # Forward = 1 unit; backward = 2 units with weight gradients (full) or 1 without (LoRA);
    # gradient checkpointing recomputes the forward once more.
    # A reference model adds one forward.
    dense_mult = (1 + 2 + gc + ref) if mode == "full" else (1 + 1 + gc + ref)
    a = dense_mult * 2 * model.llm_compute_params / rate
    # Causal attention forward: QK^T and AV, 2 FLOPs per MAC, half the matrix: 2*L*d per l**2.
    # Backward of (flash) attention ~2x forward, plus the recomputed forward.
    attn_mult = 1 + 2 + gc + ref
    b = attn_mult * 2 * model.llm_layers * model.attn_dim / rate
    # Frozen vision tower: forward only (and the reference's), full (non-causal) attention
    # inside each image.
    va = (1 + ref) * 2 * model.vision_params / rate
    vb = (1 + ref) * 4 * model.vision_layers * model.vision_width / rate
    v0 = (1 + ref) * model.vision_layers * KERNELS_PER_LAYER_PASS * KERNEL_LAUNCH_S / 4  # per-image share
    passes = (4 if gradient_checkpointing else 3) + ref
    c0 = model.llm_layers * KERNELS_PER_LAYER_PASS * passes * KERNEL_LAUNCH_S + FRAMEWORK_S
    world = hw.world
    trainable = model.llm_params if mode == "full" else model.lora_params
    shard = (world - 1) / world
    reduce_scatter = 2 * trainable * shard / hw.busbw * (1 - overlap_comm)
    all_gather = 2 * trainable * shard / hw.busbw
    optimizer = 32 * trainable / world / hw.hbm_bandwidth + OPTIMIZER_FIXED_S
    if mode == "full":
        static = 2 * model.total_params + (2 + 12) * trainable / world + ZERO_BUCKETS + FRAMEWORK_RESERVE
    else:
        static = 2 * model.total_params + 16 * trainable + FRAMEWORK_RESERVE
    if reference_model == "copy":
        static += 2 * model.total_params
    # Activations per token: checkpointed layer inputs (bf16), one layer's recompute working
    # set (~34 * hidden bytes with flash attention), and the logits path (bf16 logits, fp32
    # upcast, fp32 log-softmax saved for backward: ~12 bytes per vocab entry).
    if gradient_checkpointing:
        per_token = model.llm_layers * model.hidden * 2 + 34 * model.hidden + 12 * model.vocab
    else:
        per_token = model.llm_layers * 34 * model.hidden + 12 * model.vocab
    # The reference's forward runs after the policy's, whose activations are still held: one
    # layer's working set and its own logits path on top.
    per_token += ref * (34 * model.hidden + 12 * model.vocab)
    per_patch = 34 * model.vision_width  # frozen tower: no saved activations, one layer live
    return StepModel(name=f"{model.name} {mode} {hw.name}", world=world,
                     ranks_per_node=hw.gpus_per_node, c0=c0, a=a, b=b, v0=v0, va=va, vb=vb,
                     idle_s=c0, comm_micro_s=reduce_scatter, comm_opt_s=all_gather,
                     optimizer_s=optimizer, hbm_bytes=hw.hbm_bytes, static_bytes=static,
                     bytes_per_token=per_token, bytes_per_patch=per_patch)
