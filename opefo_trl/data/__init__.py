"""What training and evaluation read: math data sets, prompts, the math-verify reward and model folders.

- `loading`: presets and local files as TRL conversational prompts plus a gold `solution` column.
- `prompts`: prompt templates, chat rendering and completion text.
- `rewards`: the math-verify accuracy reward (`math_accuracy_reward`; `build_math_accuracy_reward` for a mode).
- `reward_modes`: the `math_reward_mode` option (which answers the reward pays), shared by opefo-train and opefo-eval.
- `model_files`: model paths, weight fingerprints and the context length.
"""
