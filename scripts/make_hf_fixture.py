#!/usr/bin/env python3
"""Write the Hugging Face Llama fixtures that tl-train's import tests load, made by transformers.

A small LlamaForCausalLM with grouped-query attention (4 query heads, 2 key/value heads), a
head tied to the embedding and a rotary base of 500, every weight (norm gains included)
drawn uniformly from [-0.8, 0.8) so that no transposed, permuted or swapped tensor can hide,
saved by `save_pretrained` twice:

    crates/tl-train/tests/fixtures/hf-llama/            float32, one model.safetensors
    crates/tl-train/tests/fixtures/hf-llama-bf16/       bfloat16, sharded: an index file and
                                                        model-0000k-of-0000n.safetensors

each with a byte-level BPE tokenizer.json (Python `tokenizers`, 300 tokens, `<|endoftext|>`)
and expected.json: the ids of a prompt and transformers' float32 logits at every position
(for the bf16 copy, of its bf16 weights widened to float32, which is what tinyllm trains
on). The test `hf_import` reads them without Python. Rerun this only to change the fixture:

    pip install torch transformers tokenizers
    python3 scripts/make_hf_fixture.py
"""

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

TEXT = """\
The lazy fox chases two birds near the river. A small dog sleeps under the old tree.
Children like to watch the birds; the birds like to sing in the morning.
A model imported from another library must compute what that library computes.
"""

PROMPT = "The lazy fox sings"


def tokenizer_json() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TEXT.splitlines(), trainer=trainer)
    return tokenizer


def main() -> None:
    root = Path(__file__).resolve().parent.parent / "crates/tl-train/tests/fixtures"
    tokenizer = tokenizer_json()
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    eos = tokenizer.token_to_id("<|endoftext|>")
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rms_norm_eps=1e-5,
        rope_theta=500.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.uniform_(-0.8, 0.8)
    ids = tokenizer.encode(PROMPT).ids

    for name, dtype, shard in [("hf-llama", torch.float32, None), ("hf-llama-bf16", torch.bfloat16, "20KB")]:
        out = root / name
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob("*"):
            old.unlink()
        saved = LlamaForCausalLM(config).eval()
        saved.load_state_dict(model.state_dict())
        saved = saved.to(dtype)
        kwargs = {"safe_serialization": True}
        if shard:
            kwargs["max_shard_size"] = shard
        saved.save_pretrained(out, **kwargs)
        tokenizer.save(str(out / "tokenizer.json"))
        PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(out)
        # What tinyllm computes on: the saved weights, loaded in float32 (not `saved.to`,
        # which would round the rotary frequencies to bfloat16 too).
        widened = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = widened(input_ids=torch.tensor([ids])).logits[0]
        expected = {"prompt": PROMPT, "ids": ids, "logits": logits.tolist()}
        (out / "expected.json").write_text(json.dumps(expected) + "\n")
        files = sorted(p.name for p in out.iterdir())
        print(f"wrote {out}: {files}")


if __name__ == "__main__":
    main()
