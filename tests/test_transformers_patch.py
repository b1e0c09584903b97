"""gdn_ext.torch.patch_transformers takes the calls transformers makes of the functions it replaces:
the calls of transformers' own model tests (chunk_size=4, positional order) and the keywords its
CausalLMs pass down to the layer (loss keywords, flags), in Qwen3-Next, Qwen3.5 and OLMo-Hybrid;
a patched model computes what the unpatched one does."""
import contextlib
import importlib
import os
from unittest import mock

import pytest

if os.environ.get("GDN_EXT_REQUIRE_TORCH") == "1":
    import torch
    import transformers  # noqa: F401
else:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")

import gdn_ext.torch as gt  # noqa: E402
from test_torch_interop import _in_float64  # noqa: E402  (transformers' fallbacks in float64)

MODULES = {"qwen3_next": "transformers.models.qwen3_next.modeling_qwen3_next",
           "qwen3_5": "transformers.models.qwen3_5.modeling_qwen3_5",
           "olmo_hybrid": "transformers.models.olmo_hybrid.modeling_olmo_hybrid"}


def _module(name):
    return importlib.import_module(MODULES[name])


def _inputs(seed, B=2, T=13, H=3, HV=None, K=8, V=16, dtype=torch.float32):
    """As transformers' test_gdn_chunked_matches_recurrent draws them."""
    gen = torch.Generator().manual_seed(seed)
    HV = H if HV is None else HV
    q = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    k = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    v = torch.randn(B, T, HV, V, generator=gen, dtype=dtype)
    g = -torch.rand(B, T, HV, generator=gen, dtype=dtype)
    beta = torch.rand(B, T, HV, generator=gen, dtype=dtype)
    h0 = torch.randn(B, HV, K, V, generator=gen, dtype=dtype)
    return q, k, v, g, beta, h0


# ---- the functions, called as transformers' model tests call them ------------------------------

@pytest.mark.parametrize("model", list(MODULES))
@pytest.mark.parametrize("seq_length", [3, 12, 13])
@pytest.mark.parametrize("with_initial_state", [False, True])
def test_chunked_matches_recurrent_with_chunk_size_4(model, seq_length, with_initial_state):
    """transformers' test_gdn_chunked_matches_recurrent, under the patch: chunk_size=4."""
    mod = _module(model)
    q, k, v, g, beta, h0 = _inputs(0, T=seq_length)
    h0 = h0 if with_initial_state else None
    kw = dict(g=g, beta=beta, initial_state=h0, output_final_state=True,
              use_qk_l2norm_in_kernel=True)
    want = mod.torch_chunk_gated_delta_rule(q, k, v, chunk_size=4, **kw)
    with gt.patch_transformers(mod):
        chunk = mod.torch_chunk_gated_delta_rule(q, k, v, chunk_size=4, **kw)
        recurrent = mod.torch_recurrent_gated_delta_rule(q, k, v, **kw)
    for got in (chunk, recurrent):
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 5, 16, 64, 100, 1000])
def test_any_positive_chunk_size_gives_the_exact_recurrence(chunk_size):
    """The chunk size changes rounding only: every one gives the float64 recurrence."""
    mod = _module("qwen3_next")
    q, k, v, g, beta, h0 = _inputs(1, T=21, dtype=torch.float64)
    kw = dict(g=g, beta=beta, initial_state=h0, output_final_state=True,
              use_qk_l2norm_in_kernel=True)
    want = _in_float64(mod.torch_recurrent_gated_delta_rule)(q, k, v, **kw)
    with gt.patch_transformers(mod):
        got = mod.torch_chunk_gated_delta_rule(q, k, v, chunk_size=chunk_size, **kw)
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk_size,error", [(0, ValueError), (-4, ValueError),
                                              (2.5, TypeError), (4.0, TypeError),
                                              (None, TypeError), (True, TypeError),
                                              ("4", TypeError)])
def test_chunk_size_the_fallback_cannot_use_is_refused(chunk_size, error):
    """What transformers' fallback fails on (ZeroDivisionError, a reshape or pad error) is a
    clear error under the patch, not a result."""
    mod = _module("qwen3_next")
    q, k, v, g, beta, _ = _inputs(2)
    with pytest.raises(Exception):
        mod.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, chunk_size=chunk_size)
    with gt.patch_transformers(mod), pytest.raises(error, match="chunk_size must be a positive"):
        mod.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, chunk_size=chunk_size)


@pytest.mark.parametrize("chunked", [True, False])
def test_positional_order_of_the_fallbacks(chunked):
    """query, key, value, g, beta, [chunk_size,] initial_state, output_final_state,
    use_qk_l2norm_in_kernel by position, as the fallbacks take them (fla's order differs)."""
    mod = _module("qwen3_next")
    q, k, v, g, beta, h0 = _inputs(3, HV=6)
    q, k = q[:, :, :2], k[:, :, :2]                 # grouped: 2 query/key heads, 6 value heads
    name = "torch_chunk_gated_delta_rule" if chunked else "torch_recurrent_gated_delta_rule"
    args = (q, k, v, g, beta) + ((4,) if chunked else ()) + (h0, True, True)
    want = getattr(mod, name)(*args)
    with gt.patch_transformers(mod):
        got = getattr(mod, name)(*args)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)


# What a CausalLM's forward passes down to the layer's **kwargs (loss keywords, flags,
# TransformersKwargs), plus a keyword nobody knows: the fallbacks ignore them all.
PASSED_DOWN = dict(shift_labels=torch.zeros(2, 13, dtype=torch.long), ignore_index=-1,
                   num_items_in_batch=torch.tensor(7), output_attentions=False,
                   output_hidden_states=True, use_cache=False, return_dict=True,
                   position_ids=torch.arange(13)[None], is_causal=True, max_length_q=13,
                   logits_to_keep=0, cache_position=torch.arange(13), not_a_keyword=object())


@pytest.mark.parametrize("chunked", [True, False])
def test_keywords_the_fallbacks_ignore_are_ignored(chunked):
    mod = _module("olmo_hybrid")
    q, k, v, g, beta, h0 = _inputs(4)
    name = "torch_chunk_gated_delta_rule" if chunked else "torch_recurrent_gated_delta_rule"
    kw = dict(g=g, beta=beta, initial_state=h0, output_final_state=True)
    want = getattr(mod, name)(q, k, v, **kw, **PASSED_DOWN)
    with gt.patch_transformers(mod):
        got = getattr(mod, name)(q, k, v, **kw, **PASSED_DOWN)
        plain = getattr(mod, name)(q, k, v, **kw)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)
    assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])


def test_the_dropins_still_refuse_unknown_keywords():
    """Called directly, the flash-linear-attention drop-ins keep refusing misspelt keywords."""
    q, k, v, g, beta, h0 = _inputs(5)
    for fn in (gt.chunk_gated_delta_rule, gt.fused_recurrent_gated_delta_rule):
        with pytest.raises(TypeError, match="intial_state"):
            fn(q, k, v, g=g, beta=beta, intial_state=h0)
        with pytest.raises(TypeError, match="shift_labels"):
            fn(q, k, v, g=g, beta=beta, shift_labels=None)
    with pytest.raises(ValueError, match="chunk_size must be 16, 32 or 64"):
        gt.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, chunk_size=4)


def test_fla_keywords_keep_their_meaning_and_packed_sequences_stay_apart():
    """cu_seqlens (the layers' cu_seq_lens_q) keeps packed sequences apart under the patch, as
    flash-linear-attention does (the unpatched fallback refuses it); scale is fla's scale.
    seq_idx alone is refused, as without the patch."""
    mod = _module("qwen3_next")
    q, k, v, g, beta, _ = _inputs(6, B=1, T=12, dtype=torch.float64)
    cu = torch.tensor([0, 5, 12])
    with pytest.raises(ValueError, match="packed sequences"):
        mod.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, cu_seqlens=cu)
    with pytest.raises(ValueError, match="packed sequences"):
        mod.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, seq_idx=torch.zeros(1, 12))
    raw = _in_float64(mod.torch_chunk_gated_delta_rule)
    with gt.patch_transformers(mod):
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            o, ht = getattr(mod, name)(q, k, v, g=g, beta=beta, cu_seqlens=cu,
                                       output_final_state=True, seq_idx=torch.zeros(1, 12))
            for n, (a, b) in enumerate([(0, 5), (5, 12)]):
                o_n, ht_n = raw(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b],
                                output_final_state=True)
                torch.testing.assert_close(o[:, a:b], o_n, rtol=1e-10, atol=1e-10)
                torch.testing.assert_close(ht[n:n + 1], ht_n, rtol=1e-10, atol=1e-10)
            with pytest.raises(ValueError, match="seq_idx without cu_seqlens"):
                getattr(mod, name)(q, k, v, g=g, beta=beta, seq_idx=torch.zeros(1, 12))
            o2, _ = getattr(mod, name)(q, k, v, g=g, beta=beta, scale=0.5)
            o1, _ = getattr(mod, name)(q, k, v, g=g, beta=beta, scale=1.0)
            torch.testing.assert_close(o2, 0.5 * o1, rtol=1e-12, atol=1e-12)


# ---- whole models: forward + loss with the keywords a CausalLM passes down -----------------------

def _tiny(model, dtype):
    """A randomly initialised tiny CausalLM: one Gated DeltaNet layer (2 key heads, 4 value
    heads of 8), one attention layer, dense MLPs."""
    import transformers as tf
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2,
                  layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=2,
                  linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                  linear_num_value_heads=4, max_position_embeddings=256)
    if model == "qwen3_next":
        cfg = tf.Qwen3NextConfig(head_dim=8, mlp_only_layers=[0, 1], num_experts=4,
                                 num_experts_per_tok=2, moe_intermediate_size=16,
                                 shared_expert_intermediate_size=16, **common)
        cls = tf.Qwen3NextForCausalLM
    elif model == "qwen3_5":
        cfg = tf.Qwen3_5TextConfig(head_dim=8, **common)
        cls = tf.Qwen3_5ForCausalLM
    else:
        cfg = tf.OlmoHybridConfig(pad_token_id=0, eos_token_id=1, **common)
        cls = tf.OlmoHybridForCausalLM
    return cls(cfg).to(dtype).train()


def _fallbacks_in_float64(mod):
    return mock.patch.multiple(
        mod, torch_chunk_gated_delta_rule=_in_float64(mod.torch_chunk_gated_delta_rule),
        torch_recurrent_gated_delta_rule=_in_float64(mod.torch_recurrent_gated_delta_rule))


def _run(model, ids, **kw):
    model.zero_grad()
    out = model(input_ids=ids, labels=ids, **kw)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("model", list(MODULES))
def test_patched_model_with_loss_keywords_equals_unpatched(model, dtype):
    """Training with shift_labels, ignore_index and num_items_in_batch: the same logits, loss
    and parameter gradients with and without the patch."""
    mod = _module(model)
    net = _tiny(model, dtype)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 64, (2, 13), generator=gen)
    shift = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-1)
    shift[0, :3] = -1                               # ignored positions
    kw = dict(shift_labels=shift, ignore_index=-1, num_items_in_batch=torch.tensor(20))
    if dtype == torch.float64:      # their fallback in float64 too: a tight comparison
        theirs, tol = _fallbacks_in_float64(mod), dict(rtol=1e-9, atol=1e-10)
        grad_tol = tol
    else:                           # their float32 fallback as it ships
        theirs, tol = contextlib.nullcontext(), dict(rtol=1e-4, atol=1e-5)
        grad_tol = dict(rtol=1e-3, atol=2e-4)      # decay gradients sum many float32 terms
    with theirs:
        logits_t, loss_t, grads_t = _run(net, ids, **kw)
    with gt.patch_transformers(mod), \
            mock.patch.object(gt.fla, "_fla_call", wraps=gt.fla._fla_call) as spy:
        logits_g, loss_g, grads_g = _run(net, ids, **kw)
    assert spy.call_count == 1                      # the linear-attention layer ran gdn_ext
    torch.testing.assert_close(logits_g, logits_t, **tol)
    torch.testing.assert_close(loss_g, loss_t, **tol)
    assert grads_g.keys() == grads_t.keys()
    for n in grads_g:
        scale = grads_t[n].abs().max().clamp_min(1e-12)
        torch.testing.assert_close(grads_g[n] / scale, grads_t[n] / scale, **grad_tol, msg=n)


@pytest.mark.parametrize("model", list(MODULES))
def test_patched_cached_decode_equals_unpatched(model):
    """A prefill then one cached token (the recurrent function with a state), float64."""
    from transformers import DynamicCache
    mod = _module(model)
    net = _tiny(model, torch.float64).eval()
    gen = torch.Generator().manual_seed(2)
    prompt, nxt = torch.randint(2, 64, (2, 8), generator=gen), torch.randint(2, 64, (2, 1),
                                                                             generator=gen)

    def decode():
        cache = DynamicCache(config=net.config)
        with torch.no_grad():
            first = net(input_ids=prompt, cache=cache, use_cache=True).logits
            second = net(input_ids=nxt, cache=cache, use_cache=True).logits
        return first, second

    with _fallbacks_in_float64(mod):
        want = decode()
    with gt.patch_transformers(mod), \
            mock.patch.object(gt.fla, "_fla_call", wraps=gt.fla._fla_call) as spy:
        got = decode()
    assert spy.call_count == 2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
