"""The operator schemas, pinned (EXPECTTEST_ACCEPT=1 rewrites them after a deliberate
change), and the one-to-one match between schemas and fake implementations."""

from __future__ import annotations

import expecttest
import torch

import kt_ops  # noqa: F401  (registers the operators and fakes)


def kt_schemas() -> dict[str, str]:
    return {
        str(schema.name): str(schema)
        for schema in torch._C._jit_get_all_schemas()
        if str(schema.name).startswith("kt::")
    }


class TestSchemas(expecttest.TestCase):
    def test_schemas_are_pinned(self) -> None:
        text = "\n".join(sorted(kt_schemas().values()))
        self.assertExpectedInline(
            text,
            """\
kt::dequantize_experts(Tensor packed, Tensor expert_ids, ScalarType? dtype=None) -> (Tensor, Tensor, Tensor)
kt::moe_backward(Tensor grad_output, Tensor hidden_states, Tensor topk_ids, Tensor topk_weights, Tensor packed, Tensor? live_tokens=None) -> (Tensor, Tensor)
kt::moe_forward(Tensor hidden_states, Tensor topk_ids, Tensor topk_weights, Tensor packed, Tensor? live_tokens=None) -> Tensor
kt::moe_forward_parts(Tensor hidden_states, Tensor topk_ids, Tensor topk_weights, Tensor[] parts, int[] nodes) -> Tensor
kt::moe_forward_train(Tensor hidden_states, Tensor topk_ids, Tensor topk_weights, Tensor packed, int intermediate_size, Tensor? gate_up_delta=None, Tensor? live_tokens=None) -> (Tensor, Tensor)
kt::moe_lora_backward(Tensor grad_output, Tensor hidden_states, Tensor topk_ids, Tensor topk_weights, Tensor packed, Tensor gate_a, Tensor gate_b, Tensor up_a, Tensor up_b, Tensor down_a, Tensor down_b, float scaling, Tensor? live_tokens=None, Tensor? gate_up=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)
kt::moe_lora_forward(Tensor hidden_states, Tensor topk_ids, Tensor topk_weights, Tensor packed, Tensor gate_a, Tensor gate_b, Tensor up_a, Tensor up_b, Tensor down_a, Tensor down_b, float scaling, Tensor? live_tokens=None) -> (Tensor, Tensor)
kt::moe_train_backward(Tensor grad_output, Tensor hidden_states, Tensor topk_ids, Tensor topk_weights, Tensor packed, Tensor gate_up, Tensor? live_tokens=None) -> (Tensor, Tensor, Tensor)
kt::pack_experts(Tensor gate_proj, Tensor up_proj, Tensor down_proj, str format, int group_size=0, bool scale_search=False) -> Tensor
kt::pack_fp8_experts(Tensor gate_proj, Tensor up_proj, Tensor down_proj, Tensor gate_scale, Tensor up_scale, Tensor down_scale, str format) -> Tensor
kt::pack_gguf_experts(Tensor gate_proj, Tensor up_proj, Tensor down_proj, int[] gguf_types) -> Tensor
kt::pack_int4_experts(Tensor gate_proj, Tensor up_proj, Tensor down_proj, Tensor gate_scale, Tensor up_scale, Tensor down_scale, Tensor? gate_min, Tensor? up_min, Tensor? down_min, int group_size) -> Tensor
kt::pack_int8_experts(Tensor gate_proj, Tensor up_proj, Tensor down_proj, Tensor gate_scale, Tensor up_scale, Tensor down_scale) -> Tensor""",
        )


def test_every_schema_has_one_fake_and_every_fake_a_schema() -> None:
    from torch._library.simple_registry import singleton

    schema_ops = set(kt_schemas())
    fake_ops = {name for name, entry in singleton._data.items() if name.startswith("kt::") and entry.fake_impl.kernel is not None}
    assert schema_ops, "no kt:: schemas registered"
    assert schema_ops == fake_ops, f"schemas without fakes: {schema_ops - fake_ops}; fakes without schemas: {fake_ops - schema_ops}"
