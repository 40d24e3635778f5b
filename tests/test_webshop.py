"""WebShop: its protocol and pages, its reward, the generated shop and its near misses, both anchors, WebShop's own
data read its way (on a sample written in its format), the TRL class under TRL's trainer and GiGPO's."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from datasets import Dataset
from scripted_policy import scripted, scripted_tool_trainer, tool_call
from trainer_helpers import cpu_config
from trl import GRPOConfig, GRPOTrainer

from gigpo_trl.advantages import anchor_step_groups
from gigpo_trl.dialogue import Completion, TextDialogue, prompt_messages
from gigpo_trl.env_checker import check_env
from gigpo_trl.env_pool import EnvPool
from gigpo_trl.environments.webshop import (
    PROMPT_TEMPLATE, Goal, Product, ShopSettings, WebShopEnv, WebShopToolEnv, fuzzy_ratio, generate_shop,
    generated_catalogue, greedy_policy, play, purchase_reward, read_products,
)
from gigpo_trl.envs import env_factory, fold_seeds
from gigpo_trl.rollout import collect_rollout
from gigpo_trl.tasks import Task, task_dataset
from gigpo_trl.trainer import GiGPOTrainer

pytestmark = pytest.mark.timeout(300)

DATA = Path(__file__).parent / "data" / "webshop"
SAMPLE = {"items": str(DATA / "items_shuffle_sample.json"), "attributes": str(DATA / "items_ins_v2_sample.json")}
SMALL_SHOP = {"num_products": 200, "shop_seed": 3}


@pytest.fixture(scope="module")
def shop() -> WebShopEnv:
    return WebShopEnv(**SMALL_SHOP)


def test_check_env_passes_under_both_anchors_and_the_same_seed_is_the_same_task_in_another_process(shop):
    check_env(WebShopEnv(**SMALL_SHOP))
    check_env(WebShopEnv(**SMALL_SHOP, anchor="observation"))
    code = ("from gigpo_trl.environments.webshop import WebShopEnv\n"
            f"env = WebShopEnv(**{SMALL_SHOP!r}); print(env.reset(seed=11)[0]); print(env.walkthrough)")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert other == f"{shop.reset(seed=11)[0]}\n{shop.walkthrough}\n"


def test_pages_speak_webshop_s_text_form_and_list_the_actions_as_verl_agent_does(shop):
    observation, info = shop.reset(seed=4)
    instruction = info["task"]
    assert observation == f"WebShop [SEP] Instruction: [SEP] {instruction} [SEP] Search"
    assert info["admissible_actions"] == ["search[<your query>]", "click[search]"]

    search, product_link, *options, buy = shop.walkthrough
    observation, reward, done, _, info = shop.step(search.upper().replace("SEARCH[", "search["))  # lower-cased
    results = shop._session.results  # the products that share a word with the search, 50 at most
    assert 10 < len(results) <= 50 and not done and reward == 0
    first = shop.catalogue.products[results[0]]
    assert observation.startswith(f"Instruction: [SEP] {instruction} [SEP] Back to Search [SEP] Page 1 (Total results: "
                                  f"{len(results)}) [SEP] Next > [SEP] {first.asin} [SEP] {first.title} [SEP] "
                                  f"{first.price_tag}")
    assert info["admissible_actions"] == ["click[back to search]", "click[next >]",
                                          *[f"click[{asin.lower()}]" for asin in results[:10]]]
    shop.step("click[next >]")
    assert shop._session.observation().split(" [SEP] ")[3:6] == [f"Page 2 (Total results: {len(results)})", "< Prev",
                                                                 "Next >"]
    for _ in range(4):
        shop.step("click[next >]")
    assert shop._session.observation().endswith(f"Page 6 (Total results: {len(results)}) [SEP] < Prev [SEP] Next >")
    shop.step("click[back to search]")
    assert shop._session.page == "search"


def test_an_item_page_and_its_sub_pages_and_what_a_click_on_an_option_changes(shop):
    _, info = shop.reset(seed=4)
    search, product_link, *options, buy = shop.walkthrough
    shop.step(search)
    observation, _, _, _, before = shop.step(product_link)
    product = shop.catalogue.products[product_link[6:-1].upper()]
    (name, values), = product.options.items()
    assert observation == " [SEP] ".join([
        "Instruction:", info["task"], "Back to Search", "< Prev", name, *values, product.title,
        f"Price: {product.price_tag}", "Rating: N.A.", "Description", "Features", "Reviews", "Buy Now"])
    assert before["admissible_actions"] == ["click[back to search]", "click[< prev]", "click[description]",
                                            "click[features]", "click[reviews]", "click[buy now]",
                                            *[f"click[{value}]" for value in values]]
    after_option = shop.step(options[0])
    assert after_option[0] == observation  # WebShop's page text does not show the choice
    assert after_option[4]["anchor"] != before["anchor"] and after_option[4]["anchor"][4] == ((name, options[0][6:-1]),)
    features = shop.step("click[features]")[0]
    assert features.endswith(" [SEP] ".join(["Back to Search", "< Prev", *product.bullet_points]))
    shop.step("click[< prev]")
    assert shop._session.page == "item" and shop._session.options == {name: options[0][6:-1]}
    shop.step("click[< prev]")
    assert shop._session.page == "results" and shop._session.page_number == 1 and not shop._session.options


@pytest.mark.parametrize("action, reason", [
    ("buy it", "an action is search[keywords] or click[element]"),
    ("search[   ]", "the search is empty"),
    ("click[search]", "'search' is not a clickable of this page"),
    ("click[buy now]", "'buy now' is not a clickable of this page"),
])
def test_anything_else_is_a_no_op_turn_that_says_why(shop, action, reason):
    observation, _ = shop.reset(seed=5)
    after, reward, done, truncated, info = shop.step(action)
    assert (after, reward, done, info["invalid_action"]) == (observation, 0.0, False, reason)
    assert shop.elapsed_steps == 1 and info["anchor"] == ("search",)


def test_the_oracle_wins_every_task_the_greedy_policy_none_with_options_and_the_turn_limit_truncates(shop):
    oracle = [play(shop, seed) for seed in range(40)]
    greedy = [play(shop, seed, greedy_policy) for seed in range(40)]
    assert all(reward == 1.0 and won for reward, won, _ in oracle)
    assert not any(won for _, won, _ in greedy) and all(0 < reward < 1 for reward, _, _ in greedy)
    short = WebShopEnv(**SMALL_SHOP, max_steps=2)
    short.reset(seed=0)
    short.step("search[shoes]")
    assert short.step("click[back to search]")[3]  # truncated


def goal_of(**fields) -> Goal:
    defaults = dict(asin="B0GOAL0000", instruction="i need black running shoes", attributes=("non slip", "rubber sole"),
                    options=(("color", "black"), ("size", "9")), price_upper=50.0,
                    name="Fleet Running Shoes - Non Slip, Rubber Sole", query="running shoes", category="fashion",
                    product_category="Clothing, Shoes & Jewelry › Men › Shoes › Athletic › Running")
    return Goal(**{**defaults, **fields})


def product_of(**fields) -> Product:
    defaults = dict(asin="B0GOAL0000", title="Fleet Running Shoes - Non Slip, Rubber Sole", category="fashion",
                    query="running shoes", product_category="Clothing, Shoes & Jewelry › Men › Shoes › Athletic › Running",
                    description="A running shoe.", bullet_points=("Non slip.",), pricing=(39.99,),
                    options={"color": ("black", "navy"), "size": ("8", "9")}, attributes=("non-slip", "rubber sole"))
    return Product(**{**defaults, **fields})


def test_the_reward_is_webshop_s_and_success_is_exactly_one():
    goal, product = goal_of(), product_of()
    assert purchase_reward(product, 39.99, {"color": "black", "size": "9"}, goal).reward == 1.0
    # an attribute by fuzzy ratio ("non-slip" ~ "non slip") or as a substring of a text; an option after colour
    # normalisation ("jet black" is black); the price against the bound
    assert purchase_reward(product_of(attributes=(), bullet_points=("non slip rubber sole",)), 39.99,
                           {"color": "jet black", "size": "9"}, goal).reward == 1.0
    parts = purchase_reward(product, 60.0, {"color": "navy"}, goal)
    assert (parts.attributes_matched, parts.options_matched, parts.price_ok, parts.reward) == (2, 0, False, 0.4)
    # the type factor: query, category and title nouns apart
    other = product_of(query="boots", product_category="A › B", title="Fleet Running Boots")
    assert purchase_reward(other, 39.99, {"color": "black", "size": "9"}, goal).type_factor == 1.0  # 3/6 > 0.2
    unrelated = product_of(query="boots", product_category="A › B", title="Quill Desk Lamp")
    assert purchase_reward(unrelated, 39.99, {"color": "black", "size": "9"}, goal).reward == 0.0  # no noun shared
    # WebShop compares a synthetic goal's (name, value) pair: a value whose words are a subset matches it
    assert fuzzy_ratio("large", ("size", "x-large")) == 100
    # rounded to an int as thefuzz rounds it (rapidfuzz's 85.19 would exceed 85)
    assert fuzzy_ratio("3-12x42mm bdc pro (30mm tube)", "4-16x50mm bdc pro (30mm tube)") == 85


def test_a_generated_shop_s_targets_win_and_its_near_misses_cannot_whatever_options_they_take():
    settings = ShopSettings(**SMALL_SHOP)
    families, products, prices = generate_shop(settings)
    catalogue = generated_catalogue(settings)
    kinds = set()
    for seed in range(60):
        goal = catalogue.goal_of(seed)
        family = next(family for family in families if family.target.asin == goal.asin)
        assert purchase_reward(family.target, prices[goal.asin], dict(goal.options), goal).reward == 1.0
        assert goal.asin in catalogue.search(goal.instruction.lower(), 10)  # on the first results page
        for near in family.distractors:
            choices = [dict(zip(near.options, values)) for values in itertools.product(*near.options.values())]
            assert max(purchase_reward(near, prices[near.asin], chosen, goal).reward for chosen in choices) < 1.0
            kinds.add("price" if prices[near.asin] > goal.price_upper else
                      "attribute" if set(near.attributes) != set(family.target.attributes) else "option")
    assert kinds == {"attribute", "option", "price"} and len(products) == 200
    assert [f.target.title.split(" - ")[0].split()[1:] for f in families[:2]] == [["Face", "Serum"], ["Shampoo"]]


@pytest.mark.parametrize("kwargs, message", [
    ({"num_products": 3, "distractors": 3}, "num_products must be an int of at least one family"),
    ({"options_per_product": 3}, "options_per_product must be 0, 1 or 2"),
    ({"anchor": "page"}, "anchor must be one of"),
    ({"reward": "ten"}, "reward must be one of"),
    ({"attributes": "x.json"}, "attributes, human_instructions and human_goals are for WebShop's data"),
])
def test_bad_settings_are_refused_naming_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WebShopEnv(**kwargs)


def test_copies_on_one_results_page_share_a_step_group_under_both_anchors_and_options_tell_item_pages_apart():
    """Four copies of a task: all search the instruction; on the results page two click the target, two a near miss
    (the case the paper's case study reads); then one of each pair chooses the goal's option."""
    for anchor in ("state", "observation"):
        env = WebShopEnv(**SMALL_SHOP, anchor=anchor)
        env.reset(seed=2)
        search, target, option, buy = env.walkthrough
        env.step(search)
        other = next(action for action in env._session.admissible_actions()
                     if action.startswith("click[b0") and action != target)

        plans: dict[int, list[str]] = {}

        def generate(prompts, tools):
            answers = []
            for k, prompt in enumerate(prompts):
                turn = len(plans.setdefault(k, []))
                plan = [search, target if k < 2 else other, option if k % 2 == 0 else "click[description]"]
                plans[k].append(plan[min(turn, 2)])
                answers.append(Completion([1], [2], f"<action>{plan[min(turn, 2)]}</action>"))
            return answers

        with EnvPool(env_factory("webshop", **SMALL_SHOP, anchor=anchor), 1, 4, processes=False) as pool:
            rollout = collect_rollout(pool, [Task(seed=2)], generate, max_env_steps=3, show_progress=False,
                                      dialogue=TextDialogue(PROMPT_TEMPLATE))
        steps = rollout.steps
        groups = anchor_step_groups(steps.group, steps.anchor, steps.step)
        by_step = [sorted(int(g) for g, s in zip(groups, steps.step) if s == t) for t in range(3)]
        assert len(set(by_step[0])) == 1 and len(set(by_step[1])) == 1  # the search page; the results page
        items = by_step[2]  # the target's item page (copies 0, 1) and the near miss's (2, 3)
        assert len(set(items)) == 2 and items.count(items[0]) == 2
        env.reset(seed=2)
        env.step(search)
        before = env.step(target)[4]["anchor"]
        assert (env.step(option)[4]["anchor"] != before) == (anchor == "state")  # the option chosen


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_webshop_s_files_are_read_its_way_with_fixed_prices_and_a_canonical_split_every_process_shares():
    env = WebShopEnv(**SAMPLE)
    catalogue = env.catalogue
    assert list(catalogue.products) == ["B0SAMPLE01", "B0SAMPLE02", "B0SAMPLE03", "B0SAMPLE04", "B0SAMPLE05"]
    assert catalogue.products["B0SAMPLE03"].price_tag == "$100.0"  # empty pricing: WebShop's default
    assert catalogue.products["B0SAMPLE02"].price_tag == "$12.5 to $18.0"
    assert catalogue.products["B0SAMPLE03"].options == {"color": ("walnut | oak", "white")}
    assert catalogue.num_goals == 2 * 3 + 1 + 2  # one goal per combination of the options of a product's instruction
    assert [len(catalogue.folds[fold]) for fold in ("test", "dev", "train")] == [9, 0, 0]
    code = ("from gigpo_trl.environments.webshop import WebShopEnv\n"
            f"c = WebShopEnv(**{SAMPLE!r}).catalogue\n"
            "print([c.goal_of(i).instruction for i in range(c.num_goals)], c.prices)")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert other == f"{[catalogue.goal_of(i).instruction for i in range(catalogue.num_goals)]} {catalogue.prices}\n"
    assert all(play(env, seed)[1] for seed in range(catalogue.num_goals))
    assert fold_seeds("webshop", "test", 9, **SAMPLE) == list(range(9))
    with pytest.raises(ValueError, match=r"seed must be None or a goal index in \[0, 9\)"):
        env.reset(seed=9)

    human = WebShopEnv(**SAMPLE, human_instructions=str(DATA / "items_human_ins_sample.json"), human_goals=True)
    goals = [human.catalogue.goal_of(i) for i in range(human.catalogue.num_goals)]
    assert sorted(goal.instruction for goal in goals) == [  # the one without attributes is skipped, as WebShop does
        "find me a water resistant bluetooth speaker, and price lower than 70.00 dollars",
        "i want brown hiking boots in size 10, and price lower than 90.00 dollars"]


def test_a_search_engine_s_documents_file_is_read_as_well(tmp_path):
    products = read_products(SAMPLE["items"], SAMPLE["attributes"])
    rows = [{"id": p.asin, "contents": p.document, "product": {
        "asin": p.asin, "Title": p.title, "category": p.category, "query": p.query, "product_category": p.product_category,
        "Description": p.description, "BulletPoints": list(p.bullet_points), "pricing": list(p.pricing),
        "options": {name: list(values) for name, values in p.options.items()}, "Attributes": list(p.attributes)}}
        for p in products]
    documents = write_jsonl(tmp_path / "documents.jsonl", rows)
    assert read_products(None, None, documents) == products
    env = WebShopEnv(documents=str(documents), attributes=SAMPLE["attributes"])
    assert env.catalogue.num_goals == 9 and all(play(env, seed)[1] for seed in range(9))


def test_data_that_does_not_fit_is_refused_at_load_naming_the_file_and_the_entry(tmp_path):
    items = json.loads(Path(SAMPLE["items"]).read_text())
    with pytest.raises(FileNotFoundError, match="nothing.json: no such file"):
        WebShopEnv(items=str(tmp_path / "nothing.json"), attributes=SAMPLE["attributes"])
    (tmp_path / "broken.json").write_text("[{")
    with pytest.raises(ValueError, match=r"broken.json: not JSON"):
        WebShopEnv(items=str(tmp_path / "broken.json"), attributes=SAMPLE["attributes"])
    for index, (field, message) in enumerate([("name", "needs a title"), ("pricing", "needs `pricing`")]):
        damaged = [dict(item) for item in items]
        del damaged[1][field]
        path = tmp_path / f"damaged{index}.json"
        path.write_text(json.dumps(damaged))
        with pytest.raises(ValueError, match=rf"damaged{index}.json, product 1 \(B0SAMPLE02\): a product {message}"):
            WebShopEnv(items=str(path), attributes=SAMPLE["attributes"])
    documents = write_jsonl(tmp_path / "documents.jsonl", [{"id": "x", "contents": "y"}])
    with pytest.raises(ValueError, match=r"documents.jsonl, line 1: a documents.jsonl line needs `product`"):
        WebShopEnv(documents=str(documents))


def rows(count: int) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": "Shop with the tools."}]] * count,
                              "seed": list(range(count))})


def tool_oracle(messages: list[dict], position: int) -> str:
    """The walkthrough of the row's task (found by its instruction in the first message) as tool calls, as far as the
    tool results so far say it got."""
    env = WebShopEnv(**SMALL_SHOP)
    task = next(m["content"] for m in messages if m["role"] == "user")
    next(seed for seed in range(40) if env.reset(seed=seed)[1]["task"] in task)
    kind, argument = env.walkthrough[sum(m["role"] == "tool" for m in messages)].split("[", 1)
    return tool_call(kind, **{"keywords" if kind == "search" else "element": argument[:-1]})


def test_the_tool_class_plays_the_text_environment_s_tasks_and_trains_under_gigpo(tmp_path, tool_model_path):
    tools, text = WebShopToolEnv(**SMALL_SHOP), WebShopEnv(**SMALL_SHOP)
    assert tools.reset(prompt=[], seed=7) == f" {text.reset(seed=7)[0]}"
    for action in text.walkthrough:
        kind, argument = action.split("[", 1)
        observation, *_, info = text.step(action)
        assert getattr(tools, kind)(argument[:-1]) == observation and tools.anchor == info["anchor"]
    assert tools.done and tools.won and tools.get_reward() == 1.0
    tools.reset(seed=7)
    with pytest.raises(ValueError, match="'b0nothing0' is not a clickable of this page; the clickables here: search"):
        tools.click("b0nothing0")

    config = cpu_config(tmp_path, max_completion_length=8, max_env_steps=5, max_steps=1, history_length=8,
                        steps_per_generation=1, gradient_accumulation_steps=1)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Shop."}]] * 4, "seed": [0, 1, 2, 3]})
    trainer = scripted_tool_trainer(tool_model_path, answer=tool_oracle, args=config, train_dataset=dataset,
                                    environment_factory=lambda: WebShopToolEnv(**SMALL_SHOP))
    trainer.train()
    assert all(episode.won for episode in trainer.last_rollout.episodes)
    trainer.close_environments()


def test_the_tool_class_trains_unchanged_under_trl_s_grpo_trainer(tmp_path, tool_model_path):
    config = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_steps=1,
                        max_completion_length=16, max_tool_calling_iterations=2, report_to=[], bf16=False,
                        activation_checkpointing=False, save_strategy="no")
    trainer = GRPOTrainer(tool_model_path, args=config, train_dataset=rows(4),
                          environment_factory=lambda: WebShopToolEnv(**SMALL_SHOP))
    trainer.train()
    assert trainer.state.global_step == 1
    assert sorted(tool.__name__ for tool in trainer._env_tools[None]) == ["click", "search"]


def test_the_text_environment_trains_under_gigpo_with_its_template(tmp_path, tiny_model_path):
    """The walkthrough scripted as the policy's answers on the registered template: every copy wins, the results page's
    step group holds every copy, score and success are logged."""

    def walk(prompt, tools, position):
        text = prompt_messages(prompt)[-1]["content"]
        task = text.split("Your task is to: ")[1].split(".\n")[0]
        env = WebShopEnv(**SMALL_SHOP)
        seed = next(s for s in range(8) if env.reset(seed=s)[1]["task"] == task)
        step = int(text.split("observation (step ")[1].split(")")[0])
        return f"<action>{env.walkthrough[step]}</action>"

    config = cpu_config(tmp_path, env_name="webshop", env_kwargs=SMALL_SHOP, max_env_steps=5, max_steps=1,
                        max_completion_length=8)
    trainer = scripted(GiGPOTrainer(tiny_model_path, args=config, train_dataset=task_dataset(range(4))), walk)
    trainer.train()
    trainer.close_environments()
    log = next(entry for entry in trainer.state.log_history if "env/success_rate" in entry)
    assert log["env/success_rate"] == 1.0 and log["env/score"] == 100.0 and log["env/purchased"] == 1.0


def test_the_gpu_recipe_trains_on_webshop_s_files_on_cpu(tmp_path, tiny_model_path):
    """recipes/configs/webshop_gpu.yaml as the recipe parses it, cut to one CPU update of the tiny model on the sample of
    WebShop's files; the walkthrough scripted as the answers."""
    from trl import ModelConfig, TrlParser

    from gigpo_trl import GiGPOConfig, TaskArguments

    config = Path(__file__).resolve().parents[1] / "recipes" / "configs" / "webshop_gpu.yaml"
    env_kwargs = {**SAMPLE, "reward": "success"}
    task_args, args, _ = TrlParser((TaskArguments, GiGPOConfig, ModelConfig)).parse_args_and_config(args=[
        "--config", str(config), "--output_dir", str(tmp_path), "--env_kwargs", json.dumps(env_kwargs),
        "--eval_fold", "test", "--num_train_tasks", "1", "--num_eval_tasks", "0", "--use_vllm", "false", "--bf16", "false",
        "--dtype", "float32", "--max_steps", "1", "--per_device_train_batch_size", "8", "--steps_per_generation", "1",
        "--gradient_accumulation_steps", "1", "--max_completion_length", "8", "--activation_checkpointing", "false",
        "--save_strategy", "no", "--eval_strategy", "no", "--report_to", "none", "--env_processes", "false"])

    def walk(prompt, tools, position):
        text = prompt_messages(prompt)[-1]["content"]
        env = WebShopEnv(**SAMPLE)
        task = text.split("Your task is to: ")[1].split(".\n")[0]
        next(s for s in range(9) if env.reset(seed=s)[1]["task"] == task)
        step = int(text.split("observation (step ")[1].split(")")[0])
        return f"<action>{env.walkthrough[step]}</action>"

    with pytest.raises(ValueError, match="the train fold of 'webshop' has 0 tasks"):
        task_args.datasets(args.env_name, args.env_kwargs)  # a 5-product sample: every goal is a test goal
    train = task_dataset(range(1))
    trainer = scripted(GiGPOTrainer(tiny_model_path, args=args, train_dataset=train), walk)
    trainer.train()
    trainer.close_environments()
    assert (args.num_generations, args.history_length, args.max_env_steps, args.gamma) == (8, 2, 15, 0.95)  # the paper's
    log = next(entry for entry in trainer.state.log_history if "env/success_rate" in entry)
    assert log["env/success_rate"] == 1.0 and log["env/score"] == 100.0
