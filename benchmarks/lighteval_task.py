"""lighteval's side of the opefo-eval / lighteval comparison (README, "Evaluation"): a custom task over
`benchmarks/arith20/arith20.jsonl`, prompted as `opefo-eval --prompt_template qwen_math_boxed` prompts (the problem as
the user message, the Qwen2.5-Math system prompt, the model's chat template), greedy, scored with lighteval's
math-verify metrics (pass@1, avg@1, extractive match).

Run in a virtualenv that has `lighteval==0.13.0` (not this package's):

    python benchmarks/lighteval_task.py MODEL_DIR OUT_DIR [MAX_NEW_TOKENS]

It writes `OUT_DIR/details.jsonl` (prompt token ids, completion, extracted answers and scores per problem) for
`benchmarks/lighteval_compare.py`, and lighteval's generation cache under `OUT_DIR/cache` (a rerun into the same
`OUT_DIR` reuses it: give a fresh one to generate again).
"""

import json
import os
import sys

from lighteval.metrics.metrics import Metrics
from lighteval.tasks.lighteval_task import LightevalTaskConfig
from lighteval.tasks.requests import Doc

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "arith20")
MAX_NEW_TOKENS = int(sys.argv[3]) if __name__ == "__main__" and len(sys.argv) > 3 else 128
#: opefo_trl.data.prompts.QWEN_MATH_SYSTEM_PROMPT (opefo-eval's default template), as lighteval's system prompt.
SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."


def arith_prompt(line, task_name: str | None = None):
    return Doc(task_name=task_name, query=line["problem"], choices=[str(line["answer"])], gold_index=0)


arith20 = LightevalTaskConfig(
    name="arith20",
    prompt_function=arith_prompt,
    hf_repo=DATA_DIR,
    hf_subset="default",
    hf_avail_splits=["train"],
    evaluation_splits=["train"],
    few_shots_split=None,
    few_shots_select=None,
    generation_size=MAX_NEW_TOKENS,
    metrics=[
        Metrics.pass_at_k_math(sample_params={"k": 1, "n": 1}),
        Metrics.avg_at_n_math(sample_params={"n": 1}),
        Metrics.expr_gold_metric,
    ],
    version=0,
)

TASKS_TABLE = [arith20]


def main(model_dir: str, out_dir: str) -> None:
    import xxhash
    from lighteval.logging.evaluation_tracker import EvaluationTracker
    from lighteval.models.model_input import GenerationParameters
    from lighteval.models.transformers.transformers_model import TransformersModelConfig
    from lighteval.pipeline import ParallelismManager, Pipeline, PipelineParameters
    from lighteval.tasks.registry import Registry

    # lighteval 0.13 imports every built-in task module to build its registry; offline, two fail at import
    # (tiny_benchmarks downloads a pickle, mt_bench asks the hub for its judge). Only this custom task is needed.
    Registry._load_from_files = staticmethod(lambda files, module_prefix: {})
    Registry._load_from_subdirs = staticmethod(lambda subdirs: {})
    # lighteval 0.13 caches generations under cache_dir / model_name: with a local model's absolute path that is
    # the model's own folder. Cache under out_dir instead (keyed by the folder's name).
    from lighteval.utils.cache_management import SampleCache

    cache_init = SampleCache.__init__

    def cache_outside_model(self, model_config):
        local_name = os.path.basename(os.path.normpath(model_config.model_name))
        cache_init(self, model_config.model_copy(update={"model_name": local_name}))

    SampleCache.__init__ = cache_outside_model
    # xxhash 4 refuses str; lighteval 0.13's details logger hashes the query string.
    xxh64 = xxhash.xxh64
    xxhash.xxh64 = lambda data=b"", *a, **k: xxh64(data.encode() if isinstance(data, str) else data, *a, **k)

    pipeline = Pipeline(
        tasks="arith20|0",
        pipeline_parameters=PipelineParameters(
            launcher_type=ParallelismManager.ACCELERATE, custom_tasks_directory=os.path.abspath(__file__)
        ),
        evaluation_tracker=EvaluationTracker(output_dir=out_dir, save_details=True),
        model_config=TransformersModelConfig(
            model_name=model_dir,
            cache_dir=os.path.join(out_dir, "cache"),
            device="cpu",
            dtype="float32",
            batch_size=20,
            system_prompt=SYSTEM_PROMPT,
            generation_parameters=GenerationParameters(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS),
        ),
    )
    pipeline.evaluate()
    pipeline.show_results()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "details.jsonl"), "w") as f:
        for rows in pipeline.get_details().values():
            for row in rows:  # lighteval's DetailsLogger.Detail: doc, model_response, metric
                doc, response = row.doc, row.model_response
                record = {
                    "problem_id": int(doc.id),
                    "prompt_ids": [int(t) for t in response.input_tokens],
                    "completion": response.text[0],
                    "extracted": (doc.specific or {}).get("extracted_predictions"),
                    "scores": row.metric,
                }
                f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
