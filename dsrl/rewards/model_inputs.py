"""What the models that judge the policy's responses read: the reward model's token sequences of a batch
(``RewardModelInputs``), and the checks that the reward model's or the distillation teacher's tokenizer fits.

The reward model (``reward_model.enable``) scores each row at the last token of its sequence, built one of two ways:

- same template (``RewardModelInputs.same_template``: the reward model's tokenizer has the policy's vocabulary and
  chat template): the policy's own tokens, the prompt's then every response token in the context (a multi-turn
  response's tool outputs too), with no round trip through text;
- otherwise as verl 0.9.1's reward loop does: the row's prompt messages (``Batch.raw_prompts``, which the prompts
  hold when loaded with ``keep_messages``) and one assistant message, the response decoded by the policy's
  tokenizer with its special tokens and the EOS token's text removed, rendered by the reward model's chat template
  without a generation prompt; a leading BOS text is cut and the text tokenised with the tokenizer's special tokens,
  as vLLM's classify endpoint that verl sends it to does, so a BOS the template writes appears once. A multi-turn
  response (its turns and the tool outputs between them) becomes one assistant message, as in verl; the tools the
  policy's prompt listed are not rendered.

Either way a sequence longer than ``reward_model.max_length`` keeps its last tokens, where the score is read.

This module needs torch: the package's ``__init__`` does not import it, so reward workers start without torch.
"""

from __future__ import annotations

from typing import Any

from dsrl.data.batch import Batch

POLICY = "actor_rollout_ref.model.path"


def vocabulary_difference(policy_tokenizer: Any, other_tokenizer: Any, policy: str) -> str | None:
    """How ``other_tokenizer``'s token-to-id map (``get_vocab()``, added tokens included) differs from the policy's,
    in words (``policy``: what to call the policy's, e.g. "the student's"); None when they are equal."""
    ours, theirs = policy_tokenizer.get_vocab(), other_tokenizer.get_vocab()
    if ours == theirs:
        return None
    moved = sorted(token for token in ours.keys() & theirs.keys() if ours[token] != theirs[token])
    extra, missing = sorted(theirs.keys() - ours.keys()), sorted(ours.keys() - theirs.keys())
    parts = [f"{_tokens(len(theirs))} to {len(ours)} in {policy}"]
    if moved:
        token = moved[0]
        parts.append(
            f"{_tokens(len(moved))} of both with other ids (e.g. {token!r}: {theirs[token]}, {ours[token]} in {policy})"
        )
    if extra:
        parts.append(f"{_tokens(len(extra))} not in {policy} (e.g. {extra[0]!r})")
    if missing:
        parts.append(f"{_tokens(len(missing))} of {policy} missing (e.g. {missing[0]!r})")
    return ", ".join(parts)


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def same_template(policy_tokenizer: Any, reward_tokenizer: Any) -> bool:
    """The reward model's tokenizer maps every token to the policy's id and renders chats with the same template:
    then the policy's tokens are already the reward model's input."""
    return (
        getattr(policy_tokenizer, "chat_template", None) == getattr(reward_tokenizer, "chat_template", None)
        and policy_tokenizer.get_vocab() == reward_tokenizer.get_vocab()
    )


def reward_tokenizer_problem(policy_tokenizer: Any, reward_tokenizer: Any, path: str) -> str | None:
    """Why the reward model's tokenizer cannot build its inputs (a problem line), or None. Without the policy's
    vocabulary and template each conversation is re-rendered with the reward model's chat template, so it needs
    one (and the prompts must be loaded with ``keep_messages``)."""
    if getattr(reward_tokenizer, "chat_template", None) or same_template(policy_tokenizer, reward_tokenizer):
        return None
    difference = vocabulary_difference(policy_tokenizer, reward_tokenizer, "the policy's")
    how = f"its vocabulary differs ({difference})" if difference else "the policy's has a chat template"
    return (
        f"reward_model.model.path={path}: its tokenizer has no chat template and differs from the policy's "
        f"({POLICY}): {how}. Unless it has the policy's vocabulary and chat template, the reward model reads each "
        "conversation rendered with its own chat template, and dsrl does not guess a format. Fix: point "
        "reward_model.model.path at a reward model saved with its chat template (a chat_template.jinja next to "
        "tokenizer_config.json), or at one with the policy's tokenizer and chat template"
    )


def teacher_vocabulary_problem(policy_tokenizer: Any, teacher_tokenizer: Any, path: str) -> str | None:
    """Why the distillation teacher's tokenizer does not fit the student's (a problem line), or None: the teacher's
    log-probs of the student's sampled token ids are compared with the student's, so every id must name the same
    token in both (``get_vocab()`` equal)."""
    difference = vocabulary_difference(policy_tokenizer, teacher_tokenizer, "the student's")
    if difference is None:
        return None
    return (
        f"distillation.teacher_models.teacher_model.model_path={path}: its tokenizer's vocabulary differs from the "
        f"student's ({POLICY}): {difference}. The teacher scores the student's sampled token ids, so every id must "
        "name the same token for both (the two tokenizers' get_vocab() equal). Fix: choose a teacher of the "
        "student's model family that shares its tokenizer, or a student with the teacher's tokenizer"
    )


class RewardModelInputs:
    """The reward model's token sequences of a batch's rows (the module docstring gives the two ways).

    ``policy_tokenizer``: the policy's (``actor_rollout_ref.model.path``); ``reward_tokenizer``: the reward
    model's (``reward_model.model.path``, checked by ``reward_tokenizer_problem``); ``max_length``: the longest
    sequence the reward model reads (``reward_model.max_length``).
    """

    def __init__(self, policy_tokenizer: Any, reward_tokenizer: Any, max_length: int) -> None:
        if max_length < 1:
            raise ValueError(f"reward_model.max_length={max_length}: must be >= 1")
        self.policy_tokenizer, self.reward_tokenizer, self.max_length = policy_tokenizer, reward_tokenizer, max_length
        # True: the policy's tokens are read as they are; False: the batches need raw_prompts (keep_messages)
        self.same_template = same_template(policy_tokenizer, reward_tokenizer)

    def texts(self, batch: Batch) -> list[str]:
        """Each row's conversation rendered by the reward model's chat template, its response as one assistant
        message, a leading BOS text cut: what is tokenised when the templates differ."""
        if len(batch.raw_prompts) != len(batch):
            raise ValueError(
                f"the batch holds {len(batch.raw_prompts)} raw prompts for {len(batch)} rows: a reward model with "
                "another chat template re-renders each prompt's messages, which only prompts loaded with "
                "keep_messages=True carry (dsrl.trainer.setup.load_run_prompts)"
            )
        policy, reward = self.policy_tokenizer, self.reward_tokenizer
        responses = policy.batch_decode(
            [ids[mask.bool()] for ids, mask in zip(batch.response_ids, batch.response_attention, strict=True)],
            skip_special_tokens=False,
        )
        if policy.eos_token:  # a response that ended itself ends with it; the template writes its own turn end
            responses = [response.replace(policy.eos_token, "") for response in responses]
        chats = [
            [*messages, {"role": "assistant", "content": response}]
            for messages, response in zip(batch.raw_prompts, responses, strict=True)
        ]
        texts = reward.apply_chat_template(chats, add_generation_prompt=False, tokenize=False)
        bos = reward.bos_token
        # Tokenising with special tokens writes the BOS (Llama's tokenizers); the template's would make two.
        return [text[len(bos) :] if bos and text.startswith(bos) else text for text in texts]

    def sequences(self, batch: Batch) -> tuple[list[list[int]], int]:
        """The reward model's token ids of each row, each at most ``max_length`` long, and how many rows were
        longer and lost their start (the score is read at the last token)."""
        if not len(batch):
            return [], 0
        if self.same_template:
            mask = batch.attention_mask.bool()  # [B, P + T]: the prompt's tokens, then every response token seen
            tokens = batch.input_ids[mask].tolist()
            ends = mask.sum(-1).cumsum(0).tolist()
            sequences = [tokens[start:end] for start, end in zip([0, *ends[:-1]], ends, strict=True)]
        else:
            sequences = self.reward_tokenizer(self.texts(batch), add_special_tokens=True)["input_ids"]
        truncated = sum(len(sequence) > self.max_length for sequence in sequences)
        return [sequence[-self.max_length :] for sequence in sequences], truncated
