"""``python -m fusible_ops demo``: the MoE expert block end to end on the CPU.

1. builds an expert block, runs forward and backward on synthetic routed tokens with
   caller buffers, and checks everything against a plain-PyTorch float64 reference;
2. prints the fusion plan (what ran, which backend, and why);
3. trains a small MoE regression for ``--steps`` steps (the loss on a fixed evaluation
   batch goes down);
4. prints the small-shape timing table (fused vs its peers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fusible_ops as fo

from .args import UsageError
from .bench import format_table, run_bench, uneven_splits
from .options import DEMO_DESCRIPTION as DESCRIPTION  # noqa: F401  (read as demo.DESCRIPTION)
from .options import Shape
from .recipe_training import build_toy_moe

#: the timing table's shape: large enough that the GEMMs dominate a call (at tiny shapes
#: per-call Python overhead does, see docs/benchmarks.md), small enough to take seconds
DEMO_SHAPE = Shape(experts=8, hidden=256, ffn=512, rows=2048)
DEMO_REPEATS = 10


def reference_expert_block(x, split_sizes, probs, w1, w2):
    """Independent per-expert loop in whatever dtype the arguments have."""
    ffn = w2.shape[-1]
    outs, start = [], 0
    for e, n in enumerate(split_sizes):
        h = x[start : start + n] @ w1[e].T
        a = F.silu(h[:, :ffn]) * h[:, ffn:] * probs[start : start + n, None]
        outs.append(a @ w2[e].T)
        start += n
    return torch.cat(outs)


def check_against_reference(dtype: torch.dtype = torch.bfloat16) -> fo.Sequential:
    torch.manual_seed(0)
    experts_n, hidden, ffn, rows = 8, 128, 192, 512
    split_sizes = uneven_splits(rows, experts_n)
    experts = fo.Sequential(
        fo.GroupedLinear(experts_n, hidden, 2 * ffn, dtype=dtype),
        fo.ScaledSwiGLU(),
        fo.GroupedLinear(experts_n, ffn, hidden, dtype=dtype),
    )
    x = torch.randn(rows, hidden, dtype=dtype, requires_grad=True)
    probs = torch.rand(rows, requires_grad=True)
    splits = torch.tensor(split_sizes)
    combine_buf = torch.zeros(rows + 16, hidden, dtype=dtype)  # padded tail of 16 rows
    dispatch_grad_buf = torch.empty(rows, hidden, dtype=dtype)
    out = experts(
        x,
        splits,
        probs,
        splits,
        op_kwargs={
            experts[2]: {fo.OUTPUT_BUFFER_KEY: combine_buf},
            0: {fo.GRAD_INPUT_BUFFER_KEY: dispatch_grad_buf},
        },
    )
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    ref_params = [
        experts[0].weight.detach().double().requires_grad_(),
        experts[2].weight.detach().double().requires_grad_(),
    ]
    x_ref = x.detach().double().requires_grad_()
    p_ref = probs.detach().double().requires_grad_()
    ref = reference_expert_block(x_ref, split_sizes, p_ref, *ref_params)
    ref.backward(grad_out.double())

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm().clamp_min(1e-12)).item()

    checks = {
        "output": rel(out, ref),
        "grad input": rel(x.grad, x_ref.grad),
        "grad probs": rel(probs.grad, p_ref.grad),
        "grad fc1 weight": rel(experts[0].weight.grad, ref_params[0].grad),
        "grad fc2 weight": rel(experts[2].weight.grad, ref_params[1].grad),
    }
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    print(
        f"1) expert block vs float64 reference ({experts_n} experts, {rows} rows, splits {split_sizes}, {dtype}):"
    )
    for name, err in checks.items():
        print(f"   {name:<16} relative error {err:.2e}  {'ok' if err < tolerance else 'FAIL'}")
    print(
        f"   output aliases the combine buffer: {out.data_ptr() == combine_buf.data_ptr()}; "
        f"padded tail untouched: {bool((combine_buf[rows:] == 0).all())}; "
        f"grad-input buffer holds x.grad: {torch.equal(dispatch_grad_buf, x.grad)}"
    )
    if any(err >= tolerance for err in checks.values()):
        raise SystemExit("demo: the expert block disagrees with the reference")
    print()
    print("2) fusion plan of that call:")
    print("   " + str(experts.last_plan).replace("\n", "\n   "))
    return experts


def train_small_moe(steps: int) -> None:
    """Teacher-student regression through a router + fused expert block.

    Every printed loss is the loss on one fixed evaluation batch (before the first step,
    after some steps, after the last one) and the verdict compares the first with the
    last, so the two measure the same thing and mean the same for any ``steps >= 1``: with this
    learning rate one Adam step already lowers it (about 1%), 30 steps by about a third,
    and wrong gradients raise it.
    """
    if steps < 1:
        raise ValueError(f"train_small_moe: steps must be >= 1, got {steps}")
    toy = build_toy_moe(seed=1)
    moe, teacher, optimizer, hidden = toy.moe, toy.teacher, toy.optimizer, toy.hidden
    experts_n, top_k, tokens = toy.num_experts, toy.top_k, 256

    eval_x = torch.randn(4 * tokens, hidden)
    with torch.no_grad():
        eval_target = teacher(eval_x)

    def eval_loss() -> float:
        with torch.no_grad():
            return F.mse_loss(moe(eval_x), eval_target).item()

    print(
        f"3) training a small MoE regression ({experts_n} experts, top-{top_k}, {tokens} tokens/step, "
        f"{steps} step{'s' if steps != 1 else ''}):"
    )
    before = eval_loss()
    print(f"   loss on a fixed evaluation batch of {len(eval_x)} tokens, before training: {before:.4f}")
    after = before
    for step in range(1, steps + 1):
        x = torch.randn(tokens, hidden)
        with torch.no_grad():
            target = teacher(x)
        loss = F.mse_loss(moe(x), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % max(1, steps // 6) == 0 or step == steps:
            after = eval_loss()
            print(f"   after step {step:>3}: {after:.4f}")
    print(f"   loss went {'down' if after < before else 'UP'} on that batch: {before:.4f} -> {after:.4f}")
    if not after < before:
        raise SystemExit("demo: training did not reduce the loss")


def main(args) -> int:
    if args.steps < 1:  # argparse's type refuses these; main() may be called directly
        raise UsageError(f"--steps must be a positive integer (>= 1), got {args.steps}")
    check_against_reference()
    print()
    train_small_moe(args.steps)
    print()
    shape = DEMO_SHAPE
    print(
        f"4) forward+backward time of one expert block ({shape.experts} experts, {shape.hidden} -> "
        f"2x{shape.ffn} -> {shape.hidden}, {shape.rows} rows, bf16, CPU), medians of {DEMO_REPEATS} "
        "interleaved rounds; a shape where the GEMMs, not per-call overhead, dominate:"
    )
    results = run_bench(shape, torch.bfloat16, "cpu", repeats=DEMO_REPEATS, warmup=2)
    print("   " + format_table(results).replace("\n", "\n   "))
    print("\nfull-size figures: python -m fusible_ops bench  (see docs/benchmarks.md)")
    return 0
