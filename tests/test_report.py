"""The run report (`gigpo_trl.report`), written from the records of a real tiny GiGPO run on CPU."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import matplotlib.image
import pytest
import torch
from scripted_policy import scripted_trainer
from toy_envs import Corridor

from gigpo_trl.config import GiGPOConfig
from gigpo_trl.records import read_evaluations, read_iterations, read_trajectories
from gigpo_trl.report import write_report
from gigpo_trl.tasks import task_dataset

pytestmark = pytest.mark.timeout(120)

PLOTS = ["advantages.png", "health.png", "loops.png", "outcomes.png", "panel.png", "step_groups.png"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_path) -> Path:
    """The output of a real run: 4 training rollouts, evaluations at steps 2 and 4. The scripted answers
    (tests/scripted_policy.py) hold <think> and <action> tags, and some copies win while others are cut off."""
    output_dir = tmp_path_factory.mktemp("run")
    config = GiGPOConfig(
        output_dir=str(output_dir), per_device_train_batch_size=4, num_generations=2, steps_per_generation=1,
        gradient_accumulation_steps=1, max_steps=4, max_completion_length=2, max_env_steps=4, logging_steps=1,
        report_to=[], activation_checkpointing=False, save_strategy="no", eval_strategy="steps", eval_steps=2,
        per_device_eval_batch_size=2, env_processes=False, disable_tqdm=True, seed=0,
    )
    trainer = scripted_trainer(tiny_model_path, args=config, env=Corridor, train_dataset=task_dataset(range(4)),
                              eval_dataset=task_dataset([100]))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as fast for a tiny model, and many times faster when other processes share the cores
    try:
        trainer.train()
    finally:
        torch.set_num_threads(threads)
        trainer.close_environments()
    return output_dir


@pytest.fixture(scope="module")
def report_dir(run_dir) -> Path:
    return write_report(run_dir)


def copy_of_run(run_dir: Path, destination: Path, keep=lambda record: True) -> Path:
    """The run's records in `destination`, with only the iteration records that `keep` accepts."""
    shutil.copytree(run_dir / "gigpo", destination / "gigpo")
    lines = (destination / "gigpo" / "iterations.jsonl").read_text().splitlines()
    (destination / "gigpo" / "iterations.jsonl").write_text("".join(line + "\n" for line in lines if keep(json.loads(line))))
    return destination


class StepRows(HTMLParser):
    """The cell texts (unescaped) of every data row of the page's step tables."""

    def __init__(self, page: str):
        super().__init__()
        self.rows: list[tuple[str, ...]] = []
        self._in_step_table, self._row, self._cell = False, None, None
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self._in_step_table = ("class", "steps") in attrs
        elif tag == "tr" and self._in_step_table:
            self._row = []
        elif tag == "td" and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None:
            self._row.append("".join(self._cell))
            self._cell = None
        elif tag == "tr" and self._row:
            self.rows.append(tuple(self._row))
            self._row = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def state_after(step: dict) -> str:
    mark = (" stay" if step["stay"] else " turn back" if step["turn_back"] else " revisit" if step["revisit"]
            else "")
    return f"#{step['next_state']}{mark}"


def validity(step: dict) -> str:
    """Well-formed; off-format but mapped onto an admissible action by the lenient parser, which the game played; or
    off-format and sent as written."""
    if step["valid"]:
        return "yes"
    return f"no, played ({step['action_match']})" if step["action_match"] else "no"


def expected_rows(episodes: list[dict]) -> list[tuple[str, ...]]:
    return [
        (str(step["step"]), step["observation"], step["completion"], step["action"], state_after(step), validity(step),
         f"{step['reward']:.3f}", str(step["step_group_size"]), f"{step['episode_advantage']:.3f}",
         f"{step['step_advantage']:.3f}", f"{step['advantage']:.3f}")
        for episode in episodes
        for step in episode["steps"]
    ]


def assert_valid_plots(report_dir: Path) -> None:
    for name in PLOTS:
        path = report_dir / name
        assert path.read_bytes().startswith(PNG_SIGNATURE), name
        image = matplotlib.image.imread(path)
        assert image.shape[0] >= 300 and image.shape[1] >= 1000, (name, image.shape)
        assert image.std() > 0, f"{name} is blank"


def test_the_run_recorded_what_the_report_needs(run_dir):
    modes = [record["mode"] for record in read_iterations(run_dir)]
    assert modes == ["train", "train", "eval", "train", "train", "eval"]
    assert sorted(read_trajectories(run_dir)) == ["eval-00000", "eval-00001"] + [f"train-{k:05d}" for k in range(4)]


def test_each_evaluation_left_one_record_of_its_distinct_tasks(run_dir):
    evaluations = read_evaluations(run_dir)
    eval_rollouts = [record for record in read_iterations(run_dir) if record["mode"] == "eval"]
    assert [record["step"] for record in evaluations] == [2, 4]
    for evaluation, rollout in zip(evaluations, eval_rollouts):  # one task, one batch: the same figures
        assert evaluation["metrics"]["env/panel_tasks"] == 1
        for name in ("env/success_rate", "env/return_mean", "env/episode_length_mean"):
            assert evaluation["metrics"][name] == pytest.approx(rollout["metrics"][name])


def test_a_run_never_evaluated_has_no_panel_plot(run_dir, tmp_path):
    copy = copy_of_run(run_dir, tmp_path)
    (copy / "gigpo" / "evaluations.jsonl").unlink()
    assert not (write_report(copy) / "panel.png").exists()


def test_the_report_folder_holds_the_plots_and_the_page(run_dir, report_dir):
    assert report_dir == run_dir / "report"
    assert sorted(path.name for path in report_dir.iterdir()) == sorted([*PLOTS, "index.html"])
    assert_valid_plots(report_dir)


def test_the_page_is_self_contained_and_shows_every_plot(report_dir):
    page = (report_dir / "index.html").read_text()
    assert sorted(re.findall(r'<img src="([^"]+)"', page)) == PLOTS
    assert "http://" not in page and "https://" not in page and "<link" not in page


def test_the_page_tables_the_last_metrics_of_training_and_evaluation(run_dir, report_dir):
    page = (report_dir / "index.html").read_text()
    last_train = read_iterations(run_dir)[-2]
    last_panel = read_evaluations(run_dir)[-1]
    assert "last training rollout<br>(step 3)" in page and "held-out panel, 1 task<br>(step 4)" in page
    success_row = re.search(r"<tr><td>share of episodes won</td>.*</tr>", page).group()
    assert success_row.endswith(f"<td>{last_train['metrics']['env/success_rate']:.4g}</td>"
                                f"<td>{last_panel['metrics']['env/success_rate']:.4g}</td></tr>")
    assert "(not exactly one &lt;action&gt; block)" in page  # the corridor's template's tags


def test_record_text_is_html_escaped(report_dir):
    page = (report_dir / "index.html").read_text()
    assert "&lt;think&gt;keep going&lt;/think&gt;&lt;action&gt;right&lt;/action&gt;" in page
    assert "<think>" not in page and "<action>" not in page


def test_the_viewer_shows_every_step_of_every_sample_episode_with_its_fields(run_dir, report_dir):
    page = (report_dir / "index.html").read_text()
    trajectories = read_trajectories(run_dir)
    recorded = [row for episodes in trajectories.values() for row in expected_rows(episodes)]
    assert Counter(StepRows(page).rows) == Counter(recorded)
    for episode in trajectories["train-00003"]:
        assert f"seed {episode['seed']} · return {episode['return']:.3f} · {episode['length']} steps" in page
    assert 'class="won">won</span>' in page and "not won, truncated" in page
    assert '<th title="the answer was exactly one &lt;action&gt; block; ' in page  # the run's own answer format
    # The copies that answer "left" in cell 0 at their first step stay there: a stay (a revisit of the start), marked.
    stays = [row for row in StepRows(page).rows if "stay" in row[4]]
    assert stays and {(row[0], row[3], row[4]) for row in stays} == {("0", "left", "#0 stay")}


def test_the_viewer_shows_the_last_rollouts_only_and_says_how_many_were_left_out(run_dir, tmp_path):
    copy = copy_of_run(run_dir, tmp_path)

    page = (write_report(copy, max_rollouts=1) / "index.html").read_text()

    trajectories = read_trajectories(copy)
    shown = expected_rows(trajectories["train-00003"]) + expected_rows(trajectories["eval-00001"])
    assert Counter(StepRows(page).rows) == Counter(shown)
    assert "the last 1 of 4 recorded training rollouts (3 older left out" in page
    assert "the last 1 of 2 recorded evaluation rollouts (1 older left out" in page


@pytest.mark.parametrize(
    ("keep", "summary"),
    [
        (lambda record: record["step"] == 0, "1 training and 0 evaluation"),
        (lambda record: record["mode"] == "train", "4 training and 0 evaluation"),
        (lambda record: record["mode"] == "eval", "0 training and 2 evaluation"),
    ],
    ids=["single-iteration", "train-only", "eval-only"],
)
def test_a_report_of_part_of_the_records_still_has_every_plot(run_dir, tmp_path, keep, summary):
    report_dir = write_report(copy_of_run(run_dir, tmp_path, keep))

    assert_valid_plots(report_dir)
    assert summary in (report_dir / "index.html").read_text()


def test_writing_a_report_opens_no_pyplot_figure(run_dir, tmp_path):
    import matplotlib.pyplot as plt  # noqa: PLC0415 (only this test needs pyplot)

    write_report(copy_of_run(run_dir, tmp_path))

    assert plt.get_fignums() == []


def test_the_command_line_writes_the_report_and_prints_the_page_path(run_dir, tmp_path):
    copy = copy_of_run(run_dir, tmp_path)

    result = subprocess.run([sys.executable, "-m", "gigpo_trl.report", str(copy)], capture_output=True, text=True, check=False)

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(copy / "report" / "index.html")
    assert (copy / "report" / "index.html").is_file()


def test_the_command_line_without_records_fails_with_a_message(tmp_path):
    result = subprocess.run([sys.executable, "-m", "gigpo_trl.report", str(tmp_path)], capture_output=True, text=True, check=False)

    assert result.returncode == 1
    assert f"no GiGPO records in {tmp_path}" in result.stderr and "iterations.jsonl is missing" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "report").exists()


@pytest.fixture(scope="module")
def sampled_run_dir(tmp_path_factory, tiny_model_path) -> Path:
    """A real run with dynamic sampling: 2 training rollouts of 2 corridors each, among which the 12-cell ones are
    never finished by either copy (no signal), so that rounds of further corridors are played."""
    output_dir = tmp_path_factory.mktemp("sampled-run")
    config = GiGPOConfig(
        output_dir=str(output_dir), per_device_train_batch_size=4, num_generations=2, steps_per_generation=1,
        gradient_accumulation_steps=1, max_steps=2, max_completion_length=2, max_env_steps=4, logging_steps=1,
        report_to=[], activation_checkpointing=False, save_strategy="no", env_processes=False, disable_tqdm=True, seed=0,
        invalid_action_penalty=0.0, dynamic_sampling_max_rounds=2, shuffle_dataset=False,
    )
    lengths = [12, 3, 12, 12, 12, 3]
    trainer = scripted_trainer(tiny_model_path, args=config, env=Corridor,
                              train_dataset=task_dataset(range(6), options=[{"length": n} for n in lengths]))
    try:
        trainer.train()
    finally:
        trainer.close_environments()
    return output_dir


def test_a_run_with_dynamic_sampling_tables_and_draws_its_groups_rounds_and_time(sampled_run_dir):
    from gigpo_trl.report import DYNAMIC_SAMPLING_METRICS

    report_dir = write_report(sampled_run_dir)

    never_evaluated = set(PLOTS) - {"panel.png"}
    assert {path.name for path in report_dir.iterdir()} == never_evaluated | {"dynamic_sampling.png", "index.html"}
    image = matplotlib.image.imread(report_dir / "dynamic_sampling.png")
    assert image.shape[1] >= 1000 and image.std() > 0
    page = (report_dir / "index.html").read_text()
    assert '<img src="dynamic_sampling.png"' in page
    last = read_iterations(sampled_run_dir)[-1]["metrics"]
    assert last["dynamic_sampling/groups_rolled"] > last["dynamic_sampling/groups_kept"]  # something was dropped
    for metric, meaning in DYNAMIC_SAMPLING_METRICS.items():
        assert f"<tr><td>{html.escape(meaning)}</td><td><code>{metric}</code></td><td>{last[metric]:.4g}</td></tr>" in page


def test_a_run_without_a_finished_rollout_has_no_report(tmp_path):
    (tmp_path / "gigpo").mkdir()
    (tmp_path / "gigpo" / "iterations.jsonl").write_text("")

    with pytest.raises(FileNotFoundError, match="iterations.jsonl is empty"):
        write_report(tmp_path)


def test_held_out_figures_are_the_panel_s_when_it_was_played_in_several_chunks(tmp_path):
    """The search recipe's case (issue 92): a panel of 40 tasks played in 4 evaluation rollouts of 20 episodes, their
    success 0.35, 0.35, 0.5 and 0.1; the panel's record holds 0.325. The table's evaluation column and the plots'
    evaluation points are the panel's (its own figures; the others summed up over its chunks by what they are shares
    of), never the last chunk's; the format row names the template's action tags."""
    from gigpo_trl.records import evaluation_record, iteration_record, write_evaluation, write_records
    from gigpo_trl.report import _plot_outcomes, _plot_step_groups, panel_records

    parts = [([1, 2, 2], [0.0, 0.5, -0.5], [0.0, 0.1, -0.1])]
    train = iteration_record(8, "train", 7, {"env/success_rate": 0.5, "env/step_samples": 40.0}, parts, episodes=16,
                             answer_format="exactly one <search> or <answer> block")
    write_records(tmp_path, train, [])
    chunks = [(0.35, 0.1, 50.0), (0.35, 0.2, 40.0), (0.5, 0.0, 30.0), (0.1, 0.4, 60.0)]  # success, invalid, samples
    for rollout, (success, invalid, samples) in enumerate(chunks):
        metrics = {"env/success_rate": success, "env/invalid_action_rate": invalid, "env/step_samples": samples,
                   "env/truncated_share": 0.5, "gigpo/num_step_groups": 10.0, "gigpo/singleton_share": 0.1 * rollout}
        write_records(tmp_path, iteration_record(8, "eval", rollout, metrics, parts, episodes=20), [])
    write_evaluation(tmp_path, evaluation_record(8, {"env/success_rate": 0.325, "env/panel_tasks": 40.0},
                                                 [f"seed {k}" for k in range(40)], {}, copies=2, greedy=False))

    page = (write_report(tmp_path) / "index.html").read_text()
    success_row = re.search(r"<tr><td>share of episodes won</td>.*</tr>", page).group()
    assert "held-out panel, 40 tasks<br>(step 8)" in page and success_row.endswith("<td>0.5</td><td>0.325</td></tr>")
    invalid_row = re.search(r"<tr><td>share of answers that broke the answer format.*</tr>", page).group()
    assert "(not exactly one &lt;search&gt; or &lt;answer&gt; block)" in invalid_row
    expected = (0.1 * 50 + 0.2 * 40 + 0.0 * 30 + 0.4 * 60) / 180  # weighted by the chunks' answers
    assert invalid_row.endswith(f"<td>{expected:.4g}</td></tr>")

    panels = panel_records([r for r in read_iterations(tmp_path) if r["mode"] == "eval"], read_evaluations(tmp_path))
    assert len(panels) == 1 and panels[0]["metrics"]["env/step_samples"] == 180.0
    assert panels[0]["step_group_sizes"] == {1: 4, 2: 4}  # each chunk's one group of 1 and one of 2, added up
    outcomes = _plot_outcomes([train], panels)
    evaluation_points = [line for line in outcomes.axes[0].get_lines() if line.get_label().startswith("evaluation")]
    assert [list(line.get_ydata()) for line in evaluation_points] == [[0.325]]  # one point: the panel's
    assert " ".join(outcomes.axes[3].get_ylabel().split()).startswith(
        "share of answers not exactly one <search> or <answer> block")
    singleton_axes = _plot_step_groups([train], panels).axes[1]
    (points,) = [line for line in singleton_axes.get_lines() if line.get_label().startswith("evaluation")]
    assert list(points.get_ydata()) == [pytest.approx(0.15)]  # 0, 0.1, 0.2, 0.3 over 10 step groups each
