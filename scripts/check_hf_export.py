#!/usr/bin/env python3
"""Check that `tinyllm export` gives a model transformers computes exactly as tinyllm does.

Trains nothing. Given a run directory, it runs `tinyllm export` into a temporary directory
(or uses --exported DIR, already exported from the same run), loads the export with
`transformers.LlamaForCausalLM.from_pretrained`, runs the prompt through it, runs
`tinyllm logits --all-positions` on the run, and prints the largest absolute difference of
the logits over every position. Exits 1 when it exceeds --tolerance (default 1e-4).

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
    args = parser.parse_args()

    import torch
    from transformers import LlamaForCausalLM

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
        ids = torch.tensor([list(args.prompt.encode("utf-8"))], dtype=torch.long)
        if ids[0].tolist() != ours["ids"]:
            print("token ids differ:", ids[0].tolist(), ours["ids"], file=sys.stderr)
            return 1
        with torch.no_grad():
            theirs = model(input_ids=ids).logits[0].to(torch.float64)
    expected = torch.tensor(ours["logits"], dtype=torch.float64)
    theirs = theirs[ours["positions"]]
    difference = (theirs - expected).abs().max().item()
    ok = difference <= args.tolerance
    print(f"{len(ours['positions'])} positions x {expected.shape[1]} logits: "
          f"max |transformers - tinyllm| = {difference:.3e} "
          f"({'within' if ok else 'ABOVE'} {args.tolerance:g})")
    same_argmax = bool((theirs.argmax(-1) == expected.argmax(-1)).all())
    print(f"same most likely next byte at every position: {same_argmax}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
