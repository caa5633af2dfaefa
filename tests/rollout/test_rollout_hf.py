"""The transformers rollout engine and the weight stream from a ZeRO-3 actor, on a tiny Qwen3."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from dsrl.data.batch import Batch
from dsrl.engines import ActorEngine
from dsrl.engines.weight_sync import iter_full_parameters
from dsrl.rollout import HFRollout, SamplingParams
from dsrl.rollout.base import PartialRow
from tests.helpers.rollout import P, assert_eos_and_length_handling, prompts

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def rollout(tiny_model_dir) -> HFRollout:
    return HFRollout(str(tiny_model_dir), dtype="float32")


@pytest.fixture(scope="module")
def reference_model(tiny_model_dir):
    """The initial weights as a plain transformers model, to check the rollout against."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def forward_logits(model, batch: Batch) -> torch.Tensor:
    """[B, T, V] logits predicting each response token (prompt i paired with rows i*n .. i*n+n-1)."""
    T = batch.response_ids.shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).logits
    return logits[:, P - 1 : P + T - 1]


def test_samples_are_grouped_and_their_log_probs_match_a_forward(rollout, reference_model):
    prompt_ids, prompt_mask = prompts()
    sampling = SamplingParams(n=3, temperature=0.9, max_tokens=12, seed=5)
    out = rollout.generate(prompt_ids, prompt_mask, sampling)

    assert out.response_ids.shape == out.response_mask.shape == out.log_probs.shape == (9, 12)
    assert out.log_probs.dtype == torch.float32 and out.response_ids.dtype == torch.long
    assert len(out.finish_reasons) == 9
    mask = out.response_mask.bool()
    assert (out.log_probs[~mask] == 0).all() and (out.response_ids[~mask] == rollout.pad_token_id).all()
    # Row i*n + j continues prompt i: its log-probs are those of a forward on prompt i.
    batch = Batch.of_responses(prompt_ids, prompt_mask, out, n=3)
    expected = torch.log_softmax(forward_logits(reference_model, batch) / 0.9, -1)
    expected = expected.gather(-1, batch.response_ids[..., None]).squeeze(-1)
    torch.testing.assert_close(out.log_probs[mask], expected[mask], atol=1e-5, rtol=1e-5)
    assert len({tuple(r) for r in out.response_ids[:3].tolist()}) > 1  # n distinct samples


def test_top_k_log_probs_are_those_of_the_truncated_distribution(rollout, reference_model):
    prompt_ids, prompt_mask = prompts()
    out = rollout.generate(prompt_ids, prompt_mask, SamplingParams(n=2, temperature=1.3, top_k=5, max_tokens=8, seed=1))
    batch = Batch.of_responses(prompt_ids, prompt_mask, out, n=2)
    logits = forward_logits(reference_model, batch) / 1.3
    top = logits.topk(5, dim=-1)
    truncated = torch.full_like(logits, float("-inf")).scatter(-1, top.indices, top.values)
    mask = out.response_mask.bool()
    in_top = (top.indices == batch.response_ids[..., None]).any(-1)
    assert in_top[mask].all()
    expected = torch.log_softmax(truncated, -1).gather(-1, batch.response_ids[..., None]).squeeze(-1)
    torch.testing.assert_close(out.log_probs[mask], expected[mask], atol=1e-5, rtol=1e-5)


def test_greedy_decoding_takes_the_argmax(rollout, reference_model):
    prompt_ids, prompt_mask = prompts()
    out = rollout.generate(prompt_ids, prompt_mask, SamplingParams(do_sample=False, temperature=0.0, max_tokens=8))
    batch = Batch.of_responses(prompt_ids, prompt_mask, out, n=1)
    logits = forward_logits(reference_model, batch)
    mask = out.response_mask.bool()
    assert (logits.argmax(-1) == batch.response_ids)[mask].all()
    expected = torch.log_softmax(logits, -1).gather(-1, batch.response_ids[..., None]).squeeze(-1)
    torch.testing.assert_close(out.log_probs[mask], expected[mask], atol=1e-5, rtol=1e-5)


def test_eos_ends_the_mask_and_sets_the_finish_reason(rollout):
    prompt_ids, prompt_mask = prompts()
    # A hot temperature flattens the untrained model's distribution: EOS then comes up at ~1%/token.
    out = rollout.generate(prompt_ids, prompt_mask, SamplingParams(n=4, temperature=3.0, max_tokens=64, seed=0))
    assert_eos_and_length_handling(out, rollout.eos_token_ids, rollout.pad_token_id, max_tokens=64)


def test_a_seed_fixes_the_samples_and_leaves_the_global_rng_alone(rollout):
    prompt_ids, prompt_mask = prompts()
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=11)
    state = torch.get_rng_state()
    first = rollout.generate(prompt_ids, prompt_mask, sampling)
    assert torch.equal(torch.get_rng_state(), state)
    again = rollout.generate(prompt_ids, prompt_mask, sampling)
    other = rollout.generate(prompt_ids, prompt_mask, sampling.replace(seed=12))
    assert torch.equal(first.response_ids, again.response_ids) and torch.equal(first.log_probs, again.log_probs)
    assert not torch.equal(first.response_ids, other.response_ids)


def test_n_samples_share_their_prompt_prefill_and_draw_what_repeated_prompts_draw(rollout):
    """With n > 1 each prompt's KV cache is computed once and repeated: the samples and log-probs are
    those of the prompts repeated n times with n = 1 (the same random draws, float rounding apart)."""
    prompt_ids, prompt_mask = prompts()  # left-padded to different lengths
    sampling = SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=3)
    shared = rollout.generate(prompt_ids, prompt_mask, sampling)
    repeated = rollout.generate(
        prompt_ids.repeat_interleave(4, 0), prompt_mask.repeat_interleave(4, 0), sampling.replace(n=1)
    )
    assert torch.equal(shared.response_ids, repeated.response_ids)
    torch.testing.assert_close(shared.log_probs, repeated.log_probs, atol=1e-5, rtol=1e-5)


def test_generation_in_chunks_is_greedy_identical_and_seeded_per_chunk(tiny_model_dir, rollout):
    """micro_batch_size prompts per generate call bound the KV cache; greedy decoding does not depend on
    the chunks, and a seeded batch in chunks repeats exactly."""
    chunked = HFRollout(str(tiny_model_dir), dtype="float32", micro_batch_size=2)
    prompt_ids, prompt_mask = prompts()
    assert len(prompt_ids) > 2
    greedy = SamplingParams(n=1, do_sample=False, max_tokens=10)
    whole, parts = rollout.generate(prompt_ids, prompt_mask, greedy), chunked.generate(prompt_ids, prompt_mask, greedy)
    assert torch.equal(whole.response_ids, parts.response_ids) and torch.equal(whole.response_mask, parts.response_mask)
    torch.testing.assert_close(whole.log_probs, parts.log_probs)
    assert whole.finish_reasons == parts.finish_reasons
    sampling = SamplingParams(n=2, max_tokens=10, seed=4)
    first, again = (
        chunked.generate(prompt_ids, prompt_mask, sampling),
        chunked.generate(prompt_ids, prompt_mask, sampling),
    )
    assert first.response_ids.shape == (2 * len(prompt_ids), 10) and torch.equal(first.response_ids, again.response_ids)
    with pytest.raises(ValueError, match="micro_batch_size=0: must be >= 1"):
        HFRollout(str(tiny_model_dir), micro_batch_size=0)


def _unpadded(ids: torch.Tensor, mask: torch.Tensor) -> list[tuple[int, ...]]:
    return [tuple(row[m.bool()].tolist()) for row, m in zip(ids, mask, strict=True)]


def test_generation_stopped_and_resumed_in_chunks_gives_the_uninterrupted_greedy_tokens(rollout):
    """Partial rollout (generate_until): a greedy generation stopped after two chunks of 3 tokens, then resumed from
    the tokens it had, gives the tokens and log-probs of one uninterrupted generate; ``stop`` runs after every
    chunk, also once every row has ended; a seeded sampled continuation repeats."""
    prompt_ids, prompt_mask = prompts()
    greedy = SamplingParams(n=1, do_sample=False, max_tokens=12)
    whole = rollout.generate(prompt_ids, prompt_mask, greedy)
    rows = [PartialRow(prompt, (), 12) for prompt in _unpadded(prompt_ids, prompt_mask)]
    calls: list[list[bool]] = []

    def stop_at(count: int):
        calls.clear()
        return lambda done: calls.append(done) or len(calls) == count

    first = rollout.generate_until(rows, greedy, chunk_tokens=3, stop=stop_at(2))
    assert len(calls) == 2 and not all(calls[-1]) and all(len(p.tokens) <= 6 for p in first)
    resumed_rows = [PartialRow(r.prompt, tuple(p.tokens), 12) for r, p in zip(rows, first, strict=True)]
    rest = rollout.generate_until(resumed_rows, greedy, chunk_tokens=3, stop=stop_at(6))
    assert calls[-1] == [True] * len(rows) and calls[-2] == calls[-1]  # still asked with nothing left to generate
    for i, (a, b) in enumerate(zip(first, rest, strict=True)):
        length = int(whole.response_mask[i].sum())
        assert a.tokens + b.tokens == whole.response_ids[i, :length].tolist()
        torch.testing.assert_close(torch.tensor(a.log_probs + b.log_probs), whole.log_probs[i, :length])
        assert b.finished
    sampled = SamplingParams(n=1, max_tokens=12, seed=3)
    once, again = (rollout.generate_until(rows, sampled, chunk_tokens=5, stop=all) for _ in range(2))
    assert [p.tokens for p in once] == [p.tokens for p in again] and all(p.finished for p in once)
    with pytest.raises(ValueError, match="sampling.n=2, must be 1"):
        rollout.generate_until(rows, sampled.replace(n=2), chunk_tokens=5, stop=all)


def test_a_kv_cache_budget_sizes_the_calls_from_the_model_and_the_lengths(tiny_model_dir, rollout, monkeypatch):
    """Qwen3-8B's shape (36 layers, 8 KV heads of 128, bf16): 144 KiB per token, so 16 GB holds the cache
    of 4 prompts at n 5 and 512 + 4096 tokens, where 64 prompts would need 217 GB. The tiny model's calls
    follow its own budget and generate what one call would."""
    from transformers import Qwen3Config

    big = object.__new__(HFRollout)
    big.model = SimpleNamespace(
        config=Qwen3Config(
            num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_size=4096
        ),
        dtype=torch.bfloat16,
    )
    big.micro_batch_size, big.kv_cache_max_bytes = 64, 16e9
    assert big.kv_bytes_per_token() == 144 * 1024
    long = SamplingParams(n=5, max_tokens=4096)
    assert big.prompts_per_call(512, long) == 4  # 16e9 // (5 * 4608 * 147456)
    big.kv_cache_max_bytes = 1e9
    assert big.prompts_per_call(512, long) == 1  # at least one, even over the budget
    big.kv_cache_max_bytes = 1e15
    assert big.prompts_per_call(512, long) == 64  # at most micro_batch_size

    prompt_ids, prompt_mask = prompts()
    greedy = SamplingParams(n=1, do_sample=False, max_tokens=10)
    per_prompt = (prompt_ids.shape[1] + 10) * rollout.kv_bytes_per_token()
    budgeted = HFRollout(str(tiny_model_dir), dtype="float32", kv_cache_max_gb=2.5 * per_prompt / 1e9)
    calls = []
    generate_one = budgeted._generate
    monkeypatch.setattr(
        budgeted, "_generate", lambda ids, mask, s: calls.append(len(ids)) or generate_one(ids, mask, s)
    )
    parts, whole = budgeted.generate(prompt_ids, prompt_mask, greedy), rollout.generate(prompt_ids, prompt_mask, greedy)
    assert calls == [2] * (len(prompt_ids) // 2) + [len(prompt_ids) % 2] * (len(prompt_ids) % 2)
    assert torch.equal(whole.response_ids, parts.response_ids)


def test_ids_beyond_the_tokenizer_are_never_sampled(tiny_model_dir):
    """The output layer's padding rows (Qwen pads its vocabulary) get no probability; shown by treating
    the tiny model's ids from 40 on as padding: no response token reaches them, and the log-probs are
    those of the distribution renormalised over the rest."""
    masked = HFRollout(str(tiny_model_dir), dtype="float32")
    masked.vocab_size = 40
    prompt_ids, prompt_mask = prompts()
    out = masked.generate(prompt_ids, prompt_mask, SamplingParams(n=4, temperature=2.0, max_tokens=16, seed=3))
    mask = out.response_mask.bool()
    assert (out.response_ids[mask] < 40).all()
    batch = Batch.of_responses(prompt_ids, prompt_mask, out, n=4)
    logits = forward_logits(masked.model, batch)[..., :40] / 2.0
    expected = torch.log_softmax(logits, -1).gather(-1, batch.response_ids.clamp(max=39)[..., None]).squeeze(-1)
    torch.testing.assert_close(out.log_probs[mask], expected[mask], atol=1e-5, rtol=1e-5)


def test_sleep_moves_the_copy_off_the_device_and_wake_brings_it_back(tiny_model_dir):
    """On a device the copy lives there only while generating; a CPU "device" here, with the moves recorded."""
    engine = HFRollout(str(tiny_model_dir), dtype="float32")
    moves = []
    engine.model.to = lambda device: moves.append(str(device))
    engine.device = torch.device("cuda", 0)  # as on a GPU machine
    engine.sleep()
    engine.wake_up(["kv_cache"])  # the KV cache is allocated by generate itself
    engine.wake_up(["weights"])
    engine.wake_up()
    assert moves == ["cpu", "cuda:0", "cuda:0"]
    engine.device = torch.device("cpu")
    moves.clear()
    engine.sleep()
    assert moves == []  # on a CPU there is nowhere else to go
    assert HFRollout.static_memory is False


def test_sampling_params_refuse_nonsense():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=0)
    with pytest.raises(ValueError, match="identical"):
        SamplingParams(n=4, do_sample=False)


@pytest.fixture(scope="module")
def actor(world_of_one, make_cfg, ds_test_config) -> ActorEngine:
    return ActorEngine(
        make_cfg(
            f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero3_offload')}",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=3",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.optim.lr=0.01",
        )
    )


def test_after_a_step_and_a_sync_the_rollout_scores_like_the_actor(actor, tiny_model_dir):
    rollout = HFRollout(str(tiny_model_dir), dtype="float32")
    names = [name for name, _ in iter_full_parameters(actor.module)]
    assert set(names) == {name for name, _ in rollout.model.named_parameters()}
    assert "lm_head.weight" not in names  # tied to the embedding: sent once

    prompt_ids, prompt_mask = prompts()
    sampling = SamplingParams(n=2, temperature=0.8, max_tokens=10, seed=3)
    batch = Batch.of_responses(prompt_ids, prompt_mask, rollout.generate(prompt_ids, prompt_mask, sampling), n=2)
    mask = batch.response_mask.bool()
    old = actor.compute_log_probs(batch, temperature=0.8)["old_log_probs"]
    torch.testing.assert_close(old[mask], batch.rollout_log_probs[mask], atol=1e-5, rtol=1e-5)

    g = torch.Generator().manual_seed(0)
    advantages = torch.randn(mask.shape, generator=g) * mask
    actor.update(batch.replace(old_log_probs=old, advantages=advantages), temperature=0.8)
    rollout.update_weights(iter_full_parameters(actor.module, bucket_bytes=4096))  # many small buckets

    # Same prompts and seed after the sync: the rollout's own log-probs match the updated actor ...
    fresh = Batch.of_responses(prompt_ids, prompt_mask, rollout.generate(prompt_ids, prompt_mask, sampling), n=2)
    new = actor.compute_log_probs(fresh, temperature=0.8)["old_log_probs"]
    fresh_mask = fresh.response_mask.bool()
    torch.testing.assert_close(new[fresh_mask], fresh.rollout_log_probs[fresh_mask], atol=1e-5, rtol=1e-5)
    # ... and on the first tokens the synced copy scores like the actor now, not like before.
    synced = torch.log_softmax(forward_logits(rollout.model, batch) / 0.8, -1)
    synced = synced.gather(-1, batch.response_ids[..., None]).squeeze(-1)
    now = actor.compute_log_probs(batch, temperature=0.8)["old_log_probs"]
    torch.testing.assert_close(synced[mask], now[mask], atol=1e-5, rtol=1e-5)
    assert (now - old)[mask].abs().max() > 1e-3


def test_a_stage2_engine_streams_its_parameters_without_gathering(
    world_of_one, make_cfg, ds_test_config, tiny_model_dir
):
    # Offloading the optimizer reuses the CPU Adam op (plain ZeRO-2 on CPU would compile FusedAdam).
    z2 = ds_test_config("zero2", offload_optimizer={"device": "cpu"})
    actor = ActorEngine(make_cfg(f"actor_rollout_ref.actor.deepspeed_config={z2}"))
    streamed = dict(iter_full_parameters(actor.module, bucket_bytes=1))
    params = dict(actor.module.named_parameters())
    assert streamed.keys() == params.keys()
    for name, tensor in streamed.items():
        assert torch.equal(tensor, params[name].detach()) and tensor.data_ptr() != params[name].data_ptr()
    rollout = HFRollout(str(tiny_model_dir), dtype="float32")
    rollout.update_weights(streamed.items())


def test_update_weights_reads_everything_then_refuses_unknown_names(rollout):
    pairs = [(name, p.detach().clone()) for name, p in rollout.model.named_parameters()]
    consumed = []

    def stream():
        for pair in [("not.a.parameter", torch.zeros(1)), *pairs]:
            consumed.append(pair[0])
            yield pair

    with pytest.raises(ValueError, match="not.a.parameter"):
        rollout.update_weights(stream())
    assert len(consumed) == len(pairs) + 1


def test_update_weights_reads_everything_then_refuses_a_tensor_of_another_shape(rollout):
    pairs = [(name, p.detach().clone()) for name, p in rollout.model.named_parameters()]
    first = pairs[0][0]
    pairs[0] = (first, torch.zeros(1, 2))
    consumed = []

    def stream():
        for pair in pairs:
            consumed.append(pair[0])
            yield pair

    with pytest.raises(ValueError, match=f"{first} has shape \\(1, 2\\)"):
        rollout.update_weights(stream())
    assert len(consumed) == len(pairs)


def test_built_from_the_run_config_it_takes_the_actors_model_and_the_rollout_keys(make_cfg):
    rollout = HFRollout.from_config(
        make_cfg("actor_rollout_ref.rollout.micro_batch_size=3", "actor_rollout_ref.rollout.kv_cache_max_gb=2.5")
    )
    assert (rollout.micro_batch_size, rollout.kv_cache_max_bytes) == (3, 2.5e9)
    assert rollout.model.dtype == torch.float32  # make_cfg's actor_rollout_ref.model.dtype
    unbounded = HFRollout.from_config(make_cfg("actor_rollout_ref.rollout.kv_cache_max_gb=null"))
    assert unbounded.kv_cache_max_bytes is None and unbounded.prompts_per_call(10, SamplingParams(n=8)) == 64
