"""Compiled generation and training of HF MoE models whose experts run on fusible-ops.

``generate()`` with ``CompileConfig(fullgraph=True, dynamic=False)`` and a static cache,
over three prompt sets, with other models of the same family built and run between them,
each kept alive until the next set and then left for the garbage collector, which runs
while each graph compiles (as during a long inductor compile): the tokens equal HF's eager experts, and there are no more compiles than
with the model's default experts implementation. Plus a compiled forward + backward.
MiniMax's generate() is skipped while transformers gives it no static cache (checked per run).
"""

from __future__ import annotations

import gc

import pytest
import torch

transformers = pytest.importorskip("transformers")
fot = pytest.importorskip("fusible_ops.integrations.transformers")

from hf_tiny_models import FAMILIES, VOCAB, experts_modules, tiny_model  # noqa: E402

#: full attention: a sliding-window static cache recompiles per step with any experts
SIZES = dict(hidden=32, layers=1, experts=4, full_attention=True)
#: (batch, prompt length); one max_length, so the static cache's shape depends on the
#: batch only and the third set reuses the second's graph
PROMPTS = ((1, 5), (2, 3), (2, 6))
MAX_LENGTH = 9
#: families whose generate() transformers runs without a static cache, so never compiled
NO_STATIC_CACHE = {
    "minimax": "transformers has no static cache for MiniMax (it ignores cache_implementation and keeps "
    "its own MiniMaxCache), so generate() does not compile",
}


def _model(family: str, implementation: str | None, seed: int = 0):
    model = tiny_model(family, torch.float32, seed, **SIZES)
    if implementation is not None:
        model.set_experts_implementation(implementation)
    return model


def _prompts():
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(1, VOCAB, (batch, length), generator=gen) for batch, length in PROMPTS]


def _generate(model, ids):
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), max_length=MAX_LENGTH, do_sample=False, pad_token_id=0
    )


def _compiled_generation(family: str, implementation: str | None) -> tuple[list[torch.Tensor], int]:
    """Tokens of compiled generate() over the prompt sets, and how many graphs were compiled."""
    compiles = []

    def backend(gm, example_inputs, **options):  # options: CompileConfig.mode, unused
        compiles.append(gm)
        gc.collect()  # models dropped earlier are collected while the graph compiles
        return gm.forward

    torch._dynamo.reset()
    model = _model(family, implementation)
    config = transformers.CompileConfig(fullgraph=True, dynamic=False, backend=backend)
    config._compile_all_devices = True  # compile on CPU too
    model.generation_config.compile_config = config
    model.generation_config.cache_implementation = "static"
    tokens, previous = [], None
    for seed, ids in enumerate(_prompts()):
        tokens.append(_generate(model, ids))
        other = _model(family, implementation, seed=seed + 1)  # enters and runs ...
        with torch.no_grad():
            other(ids)
        if previous is not None:  # ... and leaves at the next set, in a cycle only gc frees
            cycle = [previous]
            cycle.append(cycle)
            del cycle
        previous = other
    assert hasattr(model, "_compiled_call"), "generate() did not compile"
    return tokens, len(compiles)


def _generation_cache(model):
    """The cache generate() used with ``cache_implementation="static"``."""
    model.generation_config.cache_implementation = "static"
    ids = _prompts()[0]
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_length=MAX_LENGTH, do_sample=False, pad_token_id=0,
        return_dict_in_generate=True,
    )  # fmt: skip
    model.generation_config.cache_implementation = None
    return out.past_key_values


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_generate_equals_eager_across_models_without_extra_recompiles(family):
    model = _model(family, "eager")
    if family in NO_STATIC_CACHE:
        cache = _generation_cache(model)
        if not isinstance(cache, transformers.StaticCache):
            pytest.skip(f"{NO_STATIC_CACHE[family]}: generate() used a {type(cache).__name__}")
        pytest.fail(f"transformers now gives {family} a static cache: remove it from NO_STATIC_CACHE")
    expected = [_generate(model, ids) for ids in _prompts()]
    tokens, compiles = _compiled_generation(family, "fusible_ops")
    for got, want in zip(tokens, expected):
        assert torch.equal(got, want), (got, want)
    # with dynamic=False every distinct static-cache shape (one per batch size) needs its own
    # graph, with any experts implementation: at that bound nothing can compile less, so the
    # default implementation is compiled only when ours needed more
    at_least = len({batch for batch, _ in PROMPTS})
    assert compiles >= at_least, compiles
    if compiles > at_least:
        _, default_compiles = _compiled_generation(family, None)
        assert compiles <= default_compiles, (compiles, default_compiles)


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_training_step_equals_eager(family):
    model = tiny_model(family, torch.float64, **SIZES).train()
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    model.set_experts_implementation("eager")
    loss = model(ids, labels=ids).loss
    loss.backward()
    # only parameters that get a gradient in eager (e.g. ERNIE's e_score_correction_bias does not)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    without_grad = [n for n, p in model.named_parameters() if p.grad is None]
    model.zero_grad()  # grads back to None
    model.set_experts_implementation("fusible_ops")
    assert fot.prepare(model) == len(experts_modules(model))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    got = compiled(ids, labels=ids).loss
    got.backward()
    # float64 over reductions of a few hundred terms: 1e-12 is ~1e4 eps
    torch.testing.assert_close(got, loss, rtol=1e-12, atol=0)
    assert [n for n, p in model.named_parameters() if p.grad is None] == without_grad
    for name, grad in grads.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-10, atol=1e-12, msg=name)
