"""docs/moe.md's single-process examples run as written; the distributed ones, marked
fragments (they need torchrun), are what test_moe_ep, test_moe_dtensor and
test_moe_dp2ep_compile check."""

from __future__ import annotations

from doc_blocks import chains, doc_blocks, run_chain


def test_moe_doc_examples_run():
    found = chains("docs/moe.md")
    assert len(found) >= 4
    namespaces = [run_chain(chain) for chain in found]  # each chain in a fresh namespace
    by_label = {chain[0].label: ns for chain, ns in zip(found, namespaces)}
    hand_built = next(ns for ns in by_label.values() if "send_buf" in ns)
    assert hand_built["out"].shape == (10, 32)
    assert hand_built["rows_out"].data_ptr() == hand_built["send_buf"].data_ptr()


def test_only_the_distributed_examples_are_fragments():
    fragments = [block for block in doc_blocks("docs/moe.md") if block.kind == "fragment"]
    assert len(fragments) == 4
    assert all("torchrun" in block.note for block in fragments)
    assert all("init_process_group" in block.code or "init_device_mesh" in block.code for block in fragments)
