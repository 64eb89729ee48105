"""Writes word_problems.jsonl beside this file: the one-step arithmetic word problems of
``opefo_trl.data.word_problems`` (seed 0) in GSM8K's format (``question``; ``answer`` ending in ``#### N``), which
`opefo-train --dataset_name gsm8k --dataset_files ...` reads. ``make demo-real`` draws its problems from the same
generator.

Deterministic; run it again to get the same file: ``python recipes/smollm2-135m-instruct/make_word_problems.py``.
"""

import json
from pathlib import Path

from opefo_trl.data.word_problems import RECIPE_PROBLEMS, gsm8k_rows

if __name__ == "__main__":
    path = Path(__file__).with_name("word_problems.jsonl")
    path.write_text("".join(json.dumps(row) + "\n" for row in gsm8k_rows()))
    print(f"wrote {RECIPE_PROBLEMS} problems to {path}")
