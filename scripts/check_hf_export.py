#!/usr/bin/env python3
"""Check that `tinyllm export` gives a model transformers computes exactly as tinyllm does.

Trains nothing. Given a run directory, it runs `tinyllm export` into a temporary directory
(or uses --exported DIR, already exported from the same run), loads the export with
`transformers.LlamaForCausalLM.from_pretrained`, runs the prompt through it, runs
`tinyllm logits --all-positions` on the run, and prints the largest absolute difference of
the logits over every position. Exits 1 when it exceeds --tolerance (default 1e-4).

Then it generates greedily both ways: `transformers.pipeline("text-generation", model=DIR)`
with the export's own tokenizer and generation_config.json (greedy), and `tinyllm sample
--temperature 0` on the run, --new-tokens tokens each, and exits 1 unless the two
continuations are the same text.

Needs torch and transformers (pip install torch transformers). Example:

    cargo build -p tl-train
    python3 scripts/check_hf_export.py runs/tiny-fp32-seed0 --tinyllm target/debug/tinyllm
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="tinyllm run directory")
    parser.add_argument("--tinyllm", default="tinyllm", help="path of the tinyllm binary")
    parser.add_argument("--exported", type=Path, help="an export of RUN_DIR (else exported here)")
    parser.add_argument("--prompt", default="The lazy fox chases two birds.")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--new-tokens", type=int, default=40, help="tokens each generates")
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM, pipeline

    with tempfile.TemporaryDirectory() as scratch:
        exported = args.exported
        if exported is None:
            exported = Path(scratch) / "hf"
            subprocess.run(
                [args.tinyllm, "export", "--from", str(args.run_dir), "--to", str(exported)],
                check=True,
            )
        output = subprocess.run(
            [args.tinyllm, "logits", "--from", str(args.run_dir), "--prompt", args.prompt,
             "--all-positions"],
            check=True, capture_output=True, text=True,
        ).stdout
        ours = json.loads(output)
        model = LlamaForCausalLM.from_pretrained(exported, torch_dtype=torch.float32)
        model.eval()
        tokenizer = AutoTokenizer.from_pretrained(exported)
        ids = torch.tensor([tokenizer(args.prompt, add_special_tokens=False)["input_ids"]], dtype=torch.long)
        if ids[0].tolist() != ours["ids"]:
            print("token ids differ:", ids[0].tolist(), ours["ids"], file=sys.stderr)
            return 1
        with torch.no_grad():
            theirs = model(input_ids=ids).logits[0].to(torch.float64)
        generator = pipeline("text-generation", model=str(exported), dtype=torch.float32)
        # The export's generation_config.json is greedy; its max_length is the context.
        generated = generator(args.prompt, max_new_tokens=args.new_tokens, return_full_text=False)
        their_text = generated[0]["generated_text"]
        sampled = subprocess.run(
            [args.tinyllm, "sample", "--from", str(args.run_dir), "--prompt", args.prompt,
             "--temperature", "0", "--tokens", str(args.new_tokens)],
            check=True, capture_output=True, text=True,
        ).stdout
    our_text = sampled[len(args.prompt):] if sampled.startswith(args.prompt) else sampled
    our_text = our_text.rstrip("\n")
    their_text = their_text.rstrip("\n")
    expected = torch.tensor(ours["logits"], dtype=torch.float64)
    theirs = theirs[ours["positions"]]
    difference = (theirs - expected).abs().max().item()
    ok = difference <= args.tolerance
    print(f"{len(ours['positions'])} positions x {expected.shape[1]} logits: "
          f"max |transformers - tinyllm| = {difference:.3e} "
          f"({'within' if ok else 'ABOVE'} {args.tolerance:g})")
    same_argmax = bool((theirs.argmax(-1) == expected.argmax(-1)).all())
    print(f"same most likely next token at every position: {same_argmax}")
    same_text = our_text == their_text
    print(f"pipeline('text-generation') greedy, {args.new_tokens} tokens: {their_text!r}")
    print(f"tinyllm sample --temperature 0:         {our_text!r}")
    print(f"the same text: {same_text}")
    return 0 if ok and same_text else 1


if __name__ == "__main__":
    sys.exit(main())
