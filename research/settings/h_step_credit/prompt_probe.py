"""Setting H's prompt probe: the base model's greedy first answer on the first N dev tasks of compass, under a prompt
template and game arguments: how often it is a shortest-path move, and the answers counted. A look far cheaper than
the screen (research/learning.py --screen, which plays whole episodes), used between rounds 4 and 6 to choose which
prompt to screen; its output of 2026-11-29 is prompt_probe.txt.

    OMP_NUM_THREADS=1 python research/settings/h_step_credit/prompt_probe.py 20 \
        "research/configs/prompt_compass_one_shot.json|{'size': 5, 'distance': 4, 'phrasing': 'orders'}"
"""

from __future__ import annotations

import ast
import sys
from collections import Counter

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gigpo_trl.envs import fold_seeds, make_env
from gigpo_trl.models import embedded_model_dir
from gigpo_trl.parsing import parse_action
from gigpo_trl.prompts import build_messages, load_template


def main(tasks: int, specs: list[str]) -> None:
    torch.set_num_threads(1)
    folder = embedded_model_dir()
    tokenizer, model = AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder)
    for spec in specs:
        template_name, kwargs = spec.split("|")
        template, kwargs = load_template(template_name), ast.literal_eval(kwargs)
        right, answers = 0, Counter()
        for seed in fold_seeds("compass", "dev", tasks):
            env = make_env("compass", **kwargs)
            observation, info = env.reset(seed=seed)
            messages = build_messages(observation, task=info["task"], admissible_actions=info["admissible_actions"],
                                      history_length=0, template=template)
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                   return_dict=True)
            output = model.generate(**prompt, max_new_tokens=12, do_sample=False)
            answer = tokenizer.decode(output[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
            action = parse_action(answer, info["admissible_actions"]).action
            answers[action] += 1
            right += action in env.walkthrough  # the walkthrough holds every move towards the exit
        print(f"{spec}: first answer a shortest-path move {right}/{tasks} {dict(answers)}", flush=True)

if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
