"""Step prompts and the action parser."""

from __future__ import annotations

import pytest

from gigpo_trl.envs import register_env
from gigpo_trl.parsing import ParsedAction, parse_action
from gigpo_trl.prompts import NUMBERED_TEMPLATE, PromptTemplate, build_messages, load_template, template_for

ACTIONS = ["go north", "take red key", "take key", "open door"]


def test_prompt_shows_task_last_k_steps_observation_numbered_actions_and_instruction():
    history = [("obs 0", "look"), ("obs 1", "go north"), ("obs 2", "take key")]
    messages = build_messages("obs 3", step=3, task="Find the key.", history=history, admissible_actions=ACTIONS, history_length=2)

    assert [m["role"] for m in messages] == ["system", "user"]
    user = messages[1]["content"]
    assert user.startswith("Your task: Find the key.")
    assert "obs 0" not in user and "[Step 1] Observation: obs 1\n[Step 1] Your action: go north" in user
    assert "[Step 2] Your action: take key" in user
    assert "Current observation (step 3):\nobs 3" in user
    assert "Admissible actions:\n1. go north\n2. take red key\n3. take key\n4. open door" in user
    assert user.endswith(PromptTemplate().instruction)


def test_prompt_without_history_actions_or_system():
    messages = build_messages("A room.", history=[("before", "look")], history_length=0, template=PromptTemplate(system=""))

    assert messages == [{"role": "user", "content": "Current observation (step 0):\nA room.\n\n" + PromptTemplate().instruction}]
    with pytest.raises(ValueError, match="history_length must be >= 0"):
        build_messages("A room.", history_length=-1)


def test_a_template_with_examples_demonstrates_the_answer_before_the_step(tmp_path):
    messages = build_messages("A room.", template=load_template("numbered_one_shot"))

    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[2]["content"] == "<action>1</action>"
    assert messages[3]["content"].endswith("Answer with <action>N</action>, where N is the number of one admissible action.")

    path = tmp_path / "template.json"
    path.write_text('{"system": "", "instruction": "Act.", "examples": [["Hi", "<action>look</action>"]]}')
    assert [m["role"] for m in build_messages("A room.", template=load_template(str(path)))] == ["user", "assistant", "user"]
    path.write_text('{"sytem": "typo"}')
    with pytest.raises(ValueError, match=r"unknown prompt template fields \['sytem'\]"):
        load_template(str(path))
    with pytest.raises(ValueError, match="neither a template name"):
        load_template("no-such-template")


@pytest.mark.parametrize("name", ["numbered_one_shot", "action_one_shot"])
def test_a_demonstration_answers_with_an_action_its_own_prompt_lists(name):
    template = load_template(name)
    for prompt, answer in template.examples:
        listed = [line.split(". ", 1)[1] for line in prompt.split("Admissible actions:\n")[1].split("\n\n")[0].splitlines()]
        parsed = parse_action(answer, listed)
        assert parsed.valid and parsed.action == "go north", (name, parsed)
        assert prompt.endswith(template.instruction)


def test_each_shipped_environment_has_a_template():
    from gigpo_trl.environments.sokoban import PROMPT_TEMPLATE

    assert template_for("sokoban") is PROMPT_TEMPLATE and "Sokoban" in PROMPT_TEMPLATE.system
    assert load_template("sokoban") is PROMPT_TEMPLATE  # a config's `prompt_template: sokoban`
    assert template_for("textworld") == template_for("my-own-env") == template_for(None) == PromptTemplate()
    with pytest.raises(ValueError, match=r"neither a template name .*, an environment's \[.*'sokoban'.*\], nor a JSON"):
        load_template("textworld")  # an environment without a template of its own names none


def test_an_environment_registered_with_a_template_is_prompted_with_it():
    from toy_envs import Corridor

    own = PromptTemplate(system="You walk a corridor.")
    register_env("templated-corridor", Corridor, overwrite=True, prompt_template=own)
    assert template_for("templated-corridor") is own and load_template("templated-corridor") is own
    register_env("templated-corridor", Corridor, overwrite=True, prompt_template="gigpo_trl.prompts:NUMBERED_TEMPLATE")
    assert template_for("templated-corridor") is NUMBERED_TEMPLATE  # named by "module:attribute", imported on use
    register_env("templated-corridor", Corridor, overwrite=True)  # a new registration without one: the generic
    assert template_for("templated-corridor") == PromptTemplate()
    with pytest.raises(ValueError, match="must be a PromptTemplate or a 'module:attribute' string"):
        register_env("templated-corridor", Corridor, overwrite=True, prompt_template="numbered")


@pytest.mark.parametrize(
    ("answer", "action", "valid", "match"),
    [
        ("<think>the key is here</think><action>take key</action>", "take key", True, "exact"),
        ("<action>  Take   KEY </action>", "take key", True, "case"),
        ("<action>3</action>", "take key", True, "number"),
        ("<action>(2)</action>", "take red key", True, "number"),
        ("<action>9</action>", "9", True, None),  # out of range: sent as it is
        ("<action>I will take red key now</action>", "take red key", True, "contained"),
        ("<action>I will take the red key now</action>", "I will take the red key now", True, None),
        ("I should go north.", "go north", False, "contained"),  # no tags: mapped, but invalid
        ("<think>go north or open door?</think>", "", False, None),  # thinking only
        ("<action>go north</action><action>open door</action>", "open door", False, "exact"),  # two actions
        ("<action></action>", "", False, None),
        ("<action>dance wildly\nand sing</action>", "dance wildly", True, None),
        ("take key and open door", "take key and open door", False, None),  # two candidates: no unique match
    ],
)
def test_parse_action(answer, action, valid, match):
    parsed = parse_action(answer, ACTIONS)

    assert (parsed.action, parsed.valid, parsed.match) == (action, valid, match)


def test_an_action_listed_more_than_once_is_still_the_one_the_text_names():
    """TextWorldExpress's Simon says lists an action up to three times (its distractors repeat it): an answer that
    names it among other words is mapped to it, not left unmapped as if two different actions were named."""
    listed = ["slice cucumber", "slice cucumber", "slice cucumber", "slice onion", "smell onion", "touch olive"]

    assert parse_action("Simon says, 'slice cucumber'.", listed) == ParsedAction("slice cucumber", False, "contained")
    assert parse_action("slice cucumber, then slice onion", listed).match is None  # two different actions


def test_parse_action_without_admissible_actions_sends_the_text():
    assert parse_action("<action>push box</action>").action == "push box"


def test_a_rambling_answer_is_cut_to_a_bounded_action():
    assert parse_action("word " * 500, ACTIONS).action == ("word " * 20).strip()  # 100 characters
    assert parse_action("word " * 500, ACTIONS, max_chars=300).action == ("word " * 60).strip()  # a template's bound


SEARCH_TAGS = ("search", "answer")


@pytest.mark.parametrize(
    ("answer", "action", "valid"),
    [
        ("<think>who?</think><search>Ada Vole</search>", "<search>Ada Vole</search>", True),
        ("<SEARCH>  Ada\n  Vole </Search> and then more", "<search>Ada Vole</search>", True),  # one line, tag as named
        ("<answer>Rome</answer>", "<answer>Rome</answer>", True),
        ("<search>Ada</search><answer>Rome</answer>", "<search>Ada</search><answer>Rome</answer>", False),  # 2 kinds
        ("<search>Ada</search>\n<search>Bo</search>", "<search>Ada</search> <search>Bo</search>", False),  # twice
        ("<search> </search>", "<search> </search>", False),  # empty
        ("<think>hmm</think>I would look up Ada.", "I would look up Ada.", False),  # no tag
        ("<search>Ada</answer>", "<search>Ada</answer>", False),  # tags that do not pair make no block
        ("<action>Ada</action>", "<action>Ada</action>", False),  # a tag not named
    ],
)
def test_with_several_tags_exactly_one_non_empty_block_is_valid_and_sent_written_out(answer, action, valid):
    assert parse_action(answer, ["Ada"], SEARCH_TAGS) == ParsedAction(action, valid)


def test_with_several_tags_what_is_sent_is_bounded_and_a_bad_tag_list_is_refused(tmp_path):
    assert parse_action(f"<search>{'Ada ' * 60}</search>", None, SEARCH_TAGS).action == f"<search>{'Ada ' * 24}Ada</search>"
    assert len(parse_action("<answer>" + "word " * 50, None, SEARCH_TAGS).action) == 100
    for tags in [(), ("search", "an swer"), ("<search>",)]:
        with pytest.raises(ValueError, match="action tags must be a non-empty list of tag names"):
            parse_action("<search>Ada</search>", None, tags)
    path = tmp_path / "template.json"
    path.write_text('{"action_tags": ["search", "answer"]}')
    assert load_template(str(path)).action_tags == SEARCH_TAGS and PromptTemplate().action_tags == ("action",)


def test_a_window_shows_the_last_k_steps_or_every_step_of_a_shorter_history():
    from gigpo_trl.prompts import history_window

    history = ["s0", "s1", "s2"]
    assert [history_window(history, k) for k in (0, None, 1, 2, 3)] == [[], [], ["s2"], ["s1", "s2"], history]
    assert history_window(history, 4) == history and history_window(history, 5) == history  # was ["s2"] and ["s1", "s2"]
    messages = build_messages("now", step=3, history=[("o0", "a0"), ("o1", "a1"), ("o2", "a2")], history_length=4)
    assert all(f"[Step {k}] Your action: a{k}" in messages[-1]["content"] for k in range(3))
