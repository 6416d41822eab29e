"""session 13 probe: where does a call's output depend on how many calls share its batch (GPU, bf16)?

The gate's consistency row at full size (random weights, bf16, H200) found engine calls whose codes part
from the one-call streaming run before any token does. Here: full size bf16, 32 admitted calls on two twin
states; each frame runs slot 0 alone (B=1) on one and slots 0..31 (B=32) on the other, eager, with the
same audio for slot 0; every module's `step` / `forward` output is recorded in call order and slot 0's rows
compared bit for bit (a module's first mismatch in call order is where the dependence starts; later ones
follow from it). After each frame slot 0's state is copied from the B=32 twin, so every frame starts equal.
Then every distinct bf16 GEMM shape of the model: rows of x[:M] @ W^T against the same rows at M=128.

    python3 docs/runs/probe_s13_1_batch.py cublaslt 3 [nosplitk,det,nocudnn]   # on the device (carry .whl)

Flags: nosplitk = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = (False, False) (no split-K
in cuBLASLt's bf16 GEMMs), det = cudnn.deterministic, nocudnn = cuDNN off."""
import collections
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd()))
from nemo_duplex.checkpoint import random_model  # noqa: E402
from nemo_duplex.config import ModelConfig  # noqa: E402
from nemo_duplex.frame_step import admit, frame_step, special_ids  # noqa: E402
from nemo_duplex.runtime import select_blas  # noqa: E402
from nemo_duplex.sampling import SamplingParams  # noqa: E402
from nemo_duplex.state import allocate_call_state, state_tensors  # noqa: E402

N, FRAMES = 32, int(sys.argv[2]) if len(sys.argv) > 2 else 4
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FLAGS = sys.argv[3].split(",") if len(sys.argv) > 3 else []
if dev.type == "cuda":
    select_blas(sys.argv[1] if len(sys.argv) > 1 else "cublaslt")
    if "nosplitk" in FLAGS:  # cuBLASLt's reduction scheme NONE for bf16: no split-K
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = (False, False)
    torch.backends.cudnn.deterministic = "det" in FLAGS
    torch.backends.cudnn.enabled = "nocudnn" not in FLAGS
    print("flags", FLAGS, {k: v for k, v in __import__("os").environ.items() if "WORKSPACE" in k})
    cfg = ModelConfig()
else:  # a smoke run of the probe itself: the tiny model in fp32 on the CPU
    from nemo_duplex.config import tiny_config
    cfg = tiny_config()
cfg = dataclasses.replace(cfg, dtype=dataclasses.replace(cfg.dtype, encoder="bf16", llm="bf16", talker="bf16"))
model, _, _ = random_model(cfg, dev, seed=0)
model.cast_for_inference().eval()
specials = special_ids(model, dev)


def admitted():
    st = allocate_call_state(model, N, FRAMES + 8, dev, max_prompt_tokens=0)
    for s in range(N):
        admit(model, st, s, None, s, SamplingParams())
    return st


states = {1: admitted(), N: admitted()}
records = {1: [], N: []}
current = [None]


def first_rows(x, b):
    """slot 0's rows of a batched output: row 0, or rows 0 and b (the talker's stream-major cond/uncond)."""
    if not torch.is_tensor(x) or x.dim() == 0:
        return None
    if x.shape[0] == b:
        return x[:1]
    if x.shape[0] == 2 * b:
        return x[[0, b]]
    return None


def recorder(name, b_of):
    def record(out):
        b = current[0]
        outs = out if isinstance(out, (tuple, list)) else (out,)
        rows = [first_rows(o, b) for o in outs]
        records[b].append((name, [r.detach().clone() if r is not None else None for r in rows]))
    return record


for mod_name, mod in model.named_modules():
    name = mod_name or "model"
    rec = recorder(name, None)
    mod.register_forward_hook(lambda m, i, o, rec=rec: rec(o))
    if hasattr(mod, "step") and callable(mod.step):
        orig = mod.step

        def stepped(*a, _orig=orig, _rec=recorder(name + ".step", None), **k):
            out = _orig(*a, **k)
            _rec(out)
            return out
        mod.step = stepped

g = torch.Generator().manual_seed(0)
first = collections.Counter()
for t in range(FRAMES):
    chunk = torch.randn(N, 1280, generator=g) * 0.1
    outs = {}
    for b in (N, 1):
        records[b].clear()
        current[0] = b
        slots = torch.arange(b, device=dev)
        with torch.no_grad():
            outs[b] = frame_step(model, states[b], slots, chunk[:b].to(dev), torch.full((b,), -1, device=dev),
                                 specials, sampling=False)
    # keyed by (module, k-th call): the RNN-T's symbol loop may run other counts of steps at other batches
    keyed = {}
    for b in (1, N):
        seen = collections.Counter()
        for name, rows in records[b]:
            keyed.setdefault((name, seen[name]), {})[b] = rows
            seen[name] += 1
    mism = []
    for (name, k), both in keyed.items():
        if len(both) < 2:
            continue
        for a, c in zip(both[1], both[N]):
            if a is not None and c is not None and a.shape == c.shape and not torch.equal(a, c):
                rel = ((a.double() - c.double()).norm() / c.double().norm().clamp_min(1e-30)).item()
                mism.append((f"{name}#{k}", rel))
                break
    summary = {k: torch.equal(getattr(outs[1], k)[:1], getattr(outs[N], k)[:1]) for k in ("enc", "text", "top2", "codes", "pcm")}
    print(f"frame {t}: slot 0 equal alone and in {N}: {summary}; {len(mism)} of {len(records[1])} module outputs differ")
    for name, rel in mism[:12]:
        print(f"    {name}: rel {rel:.2e}")
    if mism:
        first[mism[0][0]] += 1
    # slot 0's state from the B=N twin into the B=1 one (both have N + 1 rows along each slot dimension)
    for (k, v1), (_, vN) in zip(state_tensors(states[1]), state_tensors(states[N])):
        for d, size in enumerate(v1.shape):
            if size in (N + 1, 2 * (N + 1)):  # a slot dimension (the talker's pools: stream-major, 2 rows a call)
                rows = torch.tensor([0] if size == N + 1 else [0, N + 1], device=dev)
                v1.index_copy_(d, rows, vN.index_select(d, rows))
print("first differing module per frame:", dict(first))

# every distinct bf16 GEMM shape: rows of x[:M] @ W^T against the same rows at M = 128
shapes = sorted({tuple(p.shape) for n, p in model.named_parameters() if p.dim() == 2 and p.dtype == torch.bfloat16
                 and min(p.shape) >= 64 and "embed" not in n})
bad = []
for shape in shapes if dev.type == "cuda" else []:
    w = torch.randn(shape, device=dev, dtype=torch.bfloat16)
    x = torch.randn(128, shape[1], device=dev, dtype=torch.bfloat16)
    full = x @ w.T
    diff = [m for m in (1, 2, 4, 8, 16, 32, 64) if not torch.equal(x[:m] @ w.T, full[:m])]
    xx = torch.randn(256, shape[1], device=dev, dtype=torch.bfloat16)  # talker: 2 rows per call
    full2 = xx @ w.T
    diff2 = [m for m in (2, 4, 8, 16, 32, 64, 128) if not torch.equal(xx[:m] @ w.T, full2[:m])]
    if diff or diff2:
        bad.append((shape, diff, diff2))
    print(f"GEMM [M x {shape[1]}] x [{shape[1]} x {shape[0]}]: rows differ from M=128 at M = {diff}; from M=256 at {diff2}")
print(f"{len(bad)} of {len(shapes)} GEMM shapes depend on M")
