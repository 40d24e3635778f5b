"""Search QA: answer a question by searching a knowledge base, the GiGPO paper's third task family (as Search-R1).

**Generated worlds.** A task's seed generates a small world of fictional people, companies and cities, with names made
of syllables (no model can know them, so no answer can be guessed from pre-training), and one question about it. Each
entity has one passage, written from templates the seed picks, whose `contents` starts with the entity's name in
quotes on its first line, as in Search-R1's corpus (`"Name"\\ntext`). Distractors make retrieval matter: people who
share a first or a last name with a person of the question, companies that share a company's first word, and their
near-miss passages, which mention the name searched for. The same seed gives the same world and question in every
process (`random.Random(seed)`, no global state, no `hash()`).

**Question families** (`info["task_type"]`): `lookup` (one passage: "Where was A born?"), `chain` (2 or 3 hops, each
hop's answer names the next passage, the answer in the last one: "Where was the founder of C born?"), `collect`
(`collect_size` people: "Where were A and B born?", answered in any order: "X and Y" or "Y and X") and `compare` ("Who
was born earlier, A or B?"). A chain needs no memory (each hop's answer is in the latest result); collect and compare
combine passages retrieved at different steps, so a policy that sees a window of K past exchanges fails them when
they need K + 2 passages or more (`memoryless_policy`).

**The protocol** (the paper's). The observation at reset is the question (also `info["task"]`). An action is the
answer's text with `<search>query</search>` or `<answer>text</answer>`; the text after the block's closing tag is
ignored. It is invalid with neither tag, with both kinds, with either twice, with a block that is not closed, or with
an empty query or answer: an invalid action takes a turn and returns an observation that says what was wrong, with no
results, reward 0 (`info["invalid_action"]` holds the reason, None for a valid action). A search returns the top
`top_k` passages, `<information>\\nDoc 1: ...\\nDoc 2: ...\\n</information>`. An answer ends the episode: reward 1 when it
equals a golden answer after QA normalisation (`normalize_answer`), else 0; `info["won"]`. The episode is truncated
at `max_steps` turns (4, as the paper's). `info["metrics"]` gives `searches` (so far) and, on generated worlds,
`evidence_retrieved` (the share of the passages that hold the answer's facts retrieved so far).

**Anchors.** `anchor="retrieved"` (default, exact): the question and the sorted ids of the passages retrieved so far,
so two copies that searched A then B and B then A share the answer step's group, which compares answers given the
same evidence. `anchor="observation"`: the paper's rule, the latest observation's text (the question at reset), meant
for `GiGPOConfig(similarity_threshold=0.9)`; it forgets earlier results, so copies that know different things can
share a step group.

**Bring your own data**: `qa` (a jsonl file of rows with `question` and `golden_answers`, as Search-R1's) with a corpus
(`corpus`, Search-R1's `corpus.jsonl`, BM25 in process) or a retrieval server (`retriever_url`), or any `retriever`
callable (`gigpo_trl.environments.retrieval`); a task's seed picks the row `seed % len(rows)`. Reset options may also
give one row (`question`, `golden_answers`), and override the world's knobs for one task. An outage of the retrieval
server is waited out for `retriever_wait` seconds (default 300) before a search fails its trajectory.

`SearchQAToolEnv` is the same task as a TRL environment class (`environment_factory`), with tools `search` and
`answer`. `oracle_policy` and `memoryless_policy` are scripted players (tests, benches, docs); `play` runs one.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import re
import string
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gigpo_trl.env_base import BaseTextEnv, is_int
from gigpo_trl.environments.retrieval import BM25Retriever, HTTPRetriever, Passage, QARow, Retriever, read_qa
from gigpo_trl.envs import INFO_ANCHOR, INFO_METRICS, INFO_TASK, INFO_TASK_TYPE, INFO_WON
from gigpo_trl.prompts import PromptTemplate
from gigpo_trl.services import DEFAULT_SERVICE_WAIT

FAMILIES = ("lookup", "chain", "collect", "compare")
ANCHORS = ("retrieved", "observation")
ACTION_TAGS = ("search", "answer")
INFO_INVALID_ACTION = "invalid_action"
BIRTH_YEARS = (1800, 1959)  # drawn uniformly: what a policy that has not seen a birth year knows of it
# Syllables of the generated names; each kind of entity has its own, so a token names one kind.
PERSON_SYLLABLES = ("bra", "cel", "dov", "eth", "fen", "gar", "hul", "ist", "jor", "kev", "lom", "mur", "nax", "oph",
                    "pry", "quo", "ruv", "sab", "tez", "ulm", "vok", "wys", "xan", "yor", "zil")
PLACE_SYLLABLES = ("al", "bor", "cand", "dern", "el", "fal", "grim", "hav", "ir", "kel", "lun", "mor", "nor", "ost",
                   "pell", "ran", "sul", "tor", "umb", "var", "wend")
PLACE_ENDINGS = ("esk", "und", "ara", "ovel", "ith", "anth")
REGION_WORDS = ("Uplands", "Marches", "Reach", "Coast", "Vale", "Fens")
COMPANY_SYLLABLES = ("ak", "bex", "cor", "dyn", "ex", "fyr", "gol", "hax", "ix", "kry", "lux", "myr", "nov", "ox",
                     "pax", "rax", "syl", "tyr", "vex", "zan")
COMPANY_WORDS = ("Works", "Foundry", "Mills", "Trading", "Press", "Looms", "Glassworks", "Ropeworks")
OCCUPATIONS = ("clockmaker", "cartographer", "glassblower", "ferryman", "botanist", "surveyor", "weaver", "printer")

NAME = r"[A-Z][a-z'-]*(?: [A-Z][a-z'-]*)*"
YEAR = r"\d{4}"
# Passage sentences, by the facts they state; {name} is the passage's entity, {other} the one a near miss mentions.
PERSON_SENTENCES = (
    ("{name} was born in {birth_city} in {birth_year}.", "Born in {birth_city} in {birth_year}, {name} grew up there.",
     "{name} came into the world in {birth_year}, in {birth_city}."),
    ("{name} worked as a {occupation}.", "By trade, {name} was a {occupation}."),
)
COMPANY_SENTENCES = (
    ("{name} was founded by {founder} in {founding_year}.", "In {founding_year}, {founder} founded {name}.",
     "{founder} started {name} in {founding_year}."),
    ("{name} is based in {headquarters}.", "The head office of {name} is in {headquarters}."),
)
CITY_SENTENCES = (
    ("{name} is a town in {region}.", "{name} lies in {region}.", "The town of {name} belongs to {region}."),
    ("{name} was first settled in {founding_year}.", "Settlers built {name} in {founding_year}."),
)
NEAR_MISS_SENTENCES = ("{name} was often mistaken for {other}.", "{name} corresponded for years with {other}.")
FIELDS = {"birth_year": YEAR, "founding_year": YEAR, "occupation": r"[a-z]+"}  # any other field: a NAME
# Questions about one entity and the facts read along the way: each fact (but the last) names the next entity.
PATH_QUESTIONS = {
    "birth_city": ("lookup", "person", "Where was {} born?", ("birth_city",)),
    "birth_year": ("lookup", "person", "In which year was {} born?", ("birth_year",)),
    "founder": ("lookup", "company", "Who founded {}?", ("founder",)),
    "headquarters": ("lookup", "company", "Where is {} based?", ("headquarters",)),
    "region": ("lookup", "city", "In which region is {}?", ("region",)),
    "founder_birth_city": ("chain", "company", "Where was the founder of {} born?", ("founder", "birth_city")),
    "founder_birth_year": ("chain", "company", "In which year was the founder of {} born?", ("founder", "birth_year")),
    "founder_region": ("chain", "company", "In which region was the founder of {} born?",
                       ("founder", "birth_city", "region")),
}
_PATH_PATTERNS = {kind: re.compile(re.escape(spec[2]).replace(r"\{\}", f"({NAME})"))
                  for kind, spec in PATH_QUESTIONS.items()}
COLLECT_QUESTION = re.compile(r"Where were (.+) born\?")
COMPARE_QUESTION = re.compile(rf"Who was born earlier, ({NAME}) or ({NAME})\?")
INVALID_HELP = "Search with <search>query</search> or answer with <answer>text</answer>."
INFORMATION = re.compile(r"^Doc \d+: \"(.*?)\" (.*)$", re.MULTILINE)

_INSTRUCTION = "Search with <search> query </search> until you have found the answer, then answer with <answer> answer </answer>."
# The format shown as earlier chat turns (a small model follows a format it was shown in turns far more often than one
# shown inline), each turn as short as the task allows: the question and the instruction, then the results as they
# come back, the instruction naming the search last (setting J's probes: with the generic wording, "Current
# observation (step 0):" repeating the question and an instruction ending on the answer tag, SmolLM2-135M answered
# 64 of 64 questions at once; with these turns it searched 43 of 64); names the generator cannot make.
PROMPT_TEMPLATE = PromptTemplate(
    system="You answer questions by searching a knowledge base that you know nothing of beforehand.",
    task="Question: {task}\n\n" + _INSTRUCTION,
    current="{observation}",
    instruction="",
    examples=(
        ("Question: Where was Ysolde Quaine born?\n\n" + _INSTRUCTION, "<search>Ysolde Quaine</search>"),
        ('<information>\nDoc 1: "Ysolde Quaine" Ysolde Quaine was born in Pemmock in 1861. Ysolde Quaine worked as a '
         'miller.\nDoc 2: "Ysolde Brannt" Ysolde Brannt was born in Ottery in 1874.\n</information>',
         "<answer>Pemmock</answer>"),
    ),
    action_tags=ACTION_TAGS,
)


@dataclass(frozen=True)
class Entity:
    """A person, company or city of a generated world, and its facts by name (see `PERSON_SENTENCES`, ...)."""

    name: str
    kind: str
    facts: Mapping[str, str]


@dataclass(frozen=True)
class Question:
    """A task: its `text`, `family`, the `golden_answers`, and on a generated world the oracle's `searches` (the gold
    queries, in order) and `evidence` (the ids of the passages that hold the facts the answer needs)."""

    text: str
    family: str
    golden_answers: tuple[str, ...]
    searches: tuple[str, ...] = ()
    evidence: tuple[str, ...] = ()


@dataclass(frozen=True)
class World:
    """A generated world: its entities, their passages (`passages[i]` is about `entities[i]`, id `str(i)`), and the
    task's question."""

    entities: tuple[Entity, ...]
    passages: tuple[Passage, ...]
    question: Question

    @property
    def cities(self) -> tuple[str, ...]:
        return tuple(entity.name for entity in self.entities if entity.kind == "city")


@dataclass(frozen=True)
class WorldSettings:
    """The knobs of a generated task: `num_people`, `num_companies`, `num_cities` (besides distractors), `distractors`
    (people sharing a first or last name with each person the question needs, companies sharing each company's first
    word), `families` (the question families drawn from, uniformly: a family named twice is drawn twice as often) and
    `collect_size` (the people of a collect question, 2 to 4; it needs `collect_size` + 1 turns)."""

    num_people: int = 10
    num_companies: int = 4
    num_cities: int = 8
    distractors: int = 2
    families: tuple[str, ...] = FAMILIES
    collect_size: int = 2

    def __post_init__(self) -> None:
        for name, least in (("num_people", 2), ("num_companies", 1), ("num_cities", 1), ("distractors", 0)):
            value = getattr(self, name)
            if not is_int(value) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        if not is_int(self.collect_size) or not 2 <= self.collect_size <= min(4, self.num_people):
            raise ValueError(f"collect_size must be an int from 2 to {min(4, self.num_people)} (num_people), got "
                             f"{self.collect_size!r}")
        families = (self.families,) if isinstance(self.families, str) else tuple(self.families)
        if not families or any(family not in FAMILIES for family in families):
            raise ValueError(f"families must be a non-empty list of {FAMILIES}, got {self.families!r}")
        object.__setattr__(self, "families", families)


def normalize_answer(text: str) -> str:
    """QA normalisation (SQuAD's, as Search-R1 scores): lower case, no punctuation, no articles (a, an, the), single
    spaces."""
    text = "".join(character for character in text.lower() if character not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def exact_match(answer: str, golden_answers: Sequence[str]) -> bool:
    """Whether `answer` equals one of `golden_answers` after `normalize_answer`."""
    return normalize_answer(answer) in {normalize_answer(golden) for golden in golden_answers}


def read_action(text: str) -> tuple[str, str]:
    """The (kind, text) of an action: ("search", query) or ("answer", answer).

    Raises:
        ValueError: the action is invalid, saying why (see the module docstring).
    """
    opened = {tag: len(re.findall(f"<{tag}>", text, re.IGNORECASE)) for tag in ACTION_TAGS}
    if not any(opened.values()):
        raise ValueError("neither <search> nor <answer>")
    if all(opened.values()):
        raise ValueError("both <search> and <answer>")
    (kind, count), = [(tag, count) for tag, count in opened.items() if count]
    if count > 1:
        raise ValueError(f"<{kind}> twice")
    block = re.search(f"<{kind}>(.*?)</{kind}>", text, re.IGNORECASE | re.DOTALL)
    if block is None:
        raise ValueError(f"<{kind}> not closed by </{kind}>")
    content = " ".join(block.group(1).split())
    if not content:
        raise ValueError("an empty query" if kind == "search" else "an empty answer")
    return kind, content


def information(passages: Sequence[Passage]) -> str:
    """Search results as the model reads them: `<information>`, then `Doc k: "Title" text` a line (the passage's
    lines joined), then `</information>`."""
    documents = [f"Doc {k}: " + " ".join(passage.contents.split("\n")) for k, passage in enumerate(passages, start=1)]
    return "\n".join(["<information>", *(documents or ["No results."]), "</information>"])


# ----------------------------------------------------------------------------------------------------------------------
# Generated worlds.
# ----------------------------------------------------------------------------------------------------------------------


def generate_world(seed: int | None, settings: WorldSettings = WorldSettings()) -> World:
    """The world and question of a task seed (None: a random one); see the module docstring."""
    rng = random.Random(seed)
    used: set[str] = set()
    regions = [_unique(used, lambda: f"{_word(rng, PLACE_SYLLABLES, 2)} {rng.choice(REGION_WORDS)}")
               for _ in range(max(3, min(12, settings.num_cities // 2)))]
    cities = [Entity(_unique(used, lambda: _word(rng, PLACE_SYLLABLES, rng.randint(1, 3), PLACE_ENDINGS)), "city",
                     {"region": rng.choice(regions), "founding_year": str(rng.randint(900, 1799))})
              for _ in range(settings.num_cities)]
    people = [_person(rng, used, lambda: f"{_first_name(rng)} {_last_name(rng)}", cities)
              for _ in range(settings.num_people)]
    companies = [_company(rng, used, lambda: _word(rng, COMPANY_SYLLABLES, rng.randint(2, 3)), people, cities)
                 for _ in range(settings.num_companies)]
    question, needed = _question(rng, rng.choice(settings.families), settings.collect_size, people, companies, cities)

    entities, near_misses = people + companies + cities, {}
    for entity in needed:
        first, last = entity.name.split(" ", 1)
        for k in range(settings.distractors):
            if entity.kind == "company":
                twin = _company(rng, used, lambda: first, people, cities)
            elif k % 2 == 0:
                twin = _person(rng, used, lambda: f"{first} {_last_name(rng)}", cities)
            else:
                twin = _person(rng, used, lambda: f"{_first_name(rng)} {last}", cities)
            entities.append(twin)
            near_misses[twin.name] = entity.name
    rng.shuffle(entities)
    passages = tuple(Passage(str(k), _passage(rng, entity, near_misses.get(entity.name)))
                     for k, entity in enumerate(entities))
    ids = {entity.name: passage.id for entity, passage in zip(entities, passages)}
    return World(tuple(entities), passages,
                 dataclasses.replace(question, evidence=tuple(ids[name] for name in question.searches)))


def _word(rng: random.Random, syllables: Sequence[str], count: int, endings: Sequence[str] = ("",)) -> str:
    return ("".join(rng.choice(syllables) for _ in range(count)) + rng.choice(endings)).capitalize()


def _first_name(rng: random.Random) -> str:
    return _word(rng, PERSON_SYLLABLES, 2)


def _last_name(rng: random.Random) -> str:
    return _word(rng, PERSON_SYLLABLES, rng.randint(2, 3))


def _unique(used: set[str], draw: Callable[[], str]) -> str:
    """A name drawn by `draw` that no entity of the world has yet."""
    for _ in range(1000):
        name = draw()
        if name not in used:
            used.add(name)
            return name
    raise ValueError("the world's names ran out: ask for fewer entities")


def _person(rng: random.Random, used: set[str], draw_name: Callable[[], str], cities: Sequence[Entity]) -> Entity:
    return Entity(_unique(used, draw_name), "person", {
        "birth_city": rng.choice(cities).name, "birth_year": str(rng.randint(*BIRTH_YEARS)),
        "occupation": rng.choice(OCCUPATIONS)})


def _company(rng: random.Random, used: set[str], draw_first_word: Callable[[], str], people: Sequence[Entity],
             cities: Sequence[Entity]) -> Entity:
    name = _unique(used, lambda: f"{draw_first_word()} {rng.choice(COMPANY_WORDS)}")
    founder = rng.choice(people)
    return Entity(name, "company", {"founder": founder.name, "headquarters": rng.choice(cities).name,
                                    "founding_year": str(int(founder.facts["birth_year"]) + rng.randint(20, 40))})


def _question(rng: random.Random, family: str, collect_size: int, people: Sequence[Entity],
              companies: Sequence[Entity], cities: Sequence[Entity]) -> tuple[Question, list[Entity]]:
    """The question of a family, and the people and companies it names or passes through (they get distractors)."""
    by_name = {entity.name: entity for entity in [*people, *companies, *cities]}
    if family in ("lookup", "chain"):
        kind = rng.choice([kind for kind, spec in PATH_QUESTIONS.items() if spec[0] == family])
        _, entity_kind, template, facts = PATH_QUESTIONS[kind]
        path = [rng.choice({"person": people, "company": companies, "city": cities}[entity_kind])]
        for fact in facts[:-1]:
            path.append(by_name[path[-1].facts[fact]])
        question = Question(template.format(path[0].name), family, (path[-1].facts[facts[-1]],),
                            tuple(entity.name for entity in path))
        return question, [entity for entity in path if entity.kind != "city"]
    if family == "collect":
        chosen = rng.sample(list(people), collect_size)
        names = [person.name for person in chosen]
        orders = itertools.permutations([person.facts["birth_city"] for person in chosen])
        golden = tuple(dict.fromkeys(_listed(order) for order in orders))
        return Question(f"Where were {_listed(names)} born?", family, golden, tuple(names)), chosen
    first, second = rng.sample(list(people), 2)
    while first.facts["birth_year"] == second.facts["birth_year"]:  # a tie has no answer
        first, second = rng.sample(list(people), 2)
    earlier = min((first, second), key=lambda person: int(person.facts["birth_year"]))
    text = f"Who was born earlier, {first.name} or {second.name}?"
    return Question(text, family, (earlier.name,), (first.name, second.name)), [first, second]


def _listed(items: Sequence[str]) -> str:
    """'X and Y', 'X, Y and Z'."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _passage(rng: random.Random, entity: Entity, near_miss_of: str | None) -> str:
    sentences = {"person": PERSON_SENTENCES, "company": COMPANY_SENTENCES, "city": CITY_SENTENCES}[entity.kind]
    body = [rng.choice(choices).format(name=entity.name, **entity.facts) for choices in sentences]
    if near_miss_of is not None:
        body.insert(rng.randint(0, len(body)), rng.choice(NEAR_MISS_SENTENCES).format(name=entity.name,
                                                                                      other=near_miss_of))
    return f'"{entity.name}"\n' + " ".join(body)


# ----------------------------------------------------------------------------------------------------------------------
# The episode, shared by the text environment and the TRL class.
# ----------------------------------------------------------------------------------------------------------------------


class _Episode:
    """One task being played: the question, its retriever and what was retrieved so far."""

    def __init__(self, question: Question, retriever: Retriever, top_k: int) -> None:
        self.question, self.retriever, self.top_k = question, retriever, top_k
        self.retrieved: list[str] = []  # passage ids, in the order first seen
        self.searches = 0
        self.answered: str | None = None

    def search(self, query: str) -> str:
        """The `information` of the top passages for `query`."""
        (passages,) = self.retriever([query], self.top_k)
        self.searches += 1
        self.retrieved += [passage.id for passage in passages if passage.id not in self.retrieved]
        return information(passages)

    def answer(self, answer: str) -> bool:
        """Record the answer; whether it is right."""
        self.answered = answer
        return self.won

    @property
    def won(self) -> bool:
        return self.answered is not None and exact_match(self.answered, self.question.golden_answers)

    @property
    def anchor(self) -> tuple[str, tuple[str, ...]]:
        """The question and the passages retrieved so far (sorted: the order of the searches does not matter)."""
        return self.question.text, tuple(sorted(self.retrieved))

    @property
    def metrics(self) -> dict[str, float]:
        metrics = {"searches": float(self.searches)}
        if self.question.evidence:
            found = sum(passage_id in self.retrieved for passage_id in self.question.evidence)
            metrics["evidence_retrieved"] = found / len(self.question.evidence)
        return metrics


class _Tasks:
    """Where an environment's tasks come from: generated worlds (`WorldSettings`), or QA rows with a retriever.

    Args:
        settings: the world's knobs (`WorldSettings` fields).
        qa: a jsonl file of QA rows (`retrieval.read_qa`); a seed picks the row `seed % len(rows)`.
        corpus: a Search-R1 corpus file, searched with BM25 in process (`BM25Retriever.from_corpus_file`).
        retriever_url: a Search-R1 retrieval server's `/retrieve` URL (`HTTPRetriever`).
        retriever: any retriever callable.
        retriever_wait: with `retriever_url`, seconds an outage of the server is waited out before a search fails.
    """

    def __init__(self, settings: Mapping[str, Any], qa: str | None, corpus: str | None, retriever_url: str | None,
                 retriever: Retriever | None, retriever_wait: float = DEFAULT_SERVICE_WAIT) -> None:
        self.settings = WorldSettings(**settings)
        sources = {"corpus": corpus, "retriever_url": retriever_url, "retriever": retriever}
        given = [name for name, value in sources.items() if value is not None]
        if len(given) > 1:
            raise ValueError(f"give one source of passages, not {' and '.join(given)}")
        if qa is not None and not given:
            raise ValueError("qa needs passages to search: give corpus, retriever_url or retriever")
        self.rows: list[QARow] = read_qa(qa) if qa is not None else []
        self.retriever = (retriever if retriever is not None else BM25Retriever.from_corpus_file(corpus)
                          if corpus is not None else HTTPRetriever(retriever_url, wait=retriever_wait) if retriever_url is not None
                          else None)

    def task(self, seed: int | None, options: Mapping[str, Any]) -> tuple[Question, Retriever, World | None]:
        """The question of a task (a seed and options: a QA row's `question` and `golden_answers`, or knobs), the
        retriever that searches for it, and its world when it is generated."""
        row = {name: options[name] for name in ("question", "golden_answers", "data_source") if name in options}
        knobs = {name: value for name, value in options.items() if name not in row}
        if row:
            if knobs:
                raise ValueError(f"a QA row's task takes no world knobs, got {sorted(knobs)}")
            return self._qa_question(QARow.of(row, "the task's options")), self._searcher("a QA row"), None
        if self.rows:
            if knobs:
                raise ValueError(f"tasks of a QA file take no world knobs, got {sorted(knobs)}")
            row_index = seed % len(self.rows) if seed is not None else random.Random().randrange(len(self.rows))
            return self._qa_question(self.rows[row_index]), self._searcher("a QA file"), None
        world = generate_world(seed, dataclasses.replace(self.settings, **knobs) if knobs else self.settings)
        return world.question, BM25Retriever(world.passages), world

    def _searcher(self, what: str) -> Retriever:
        if self.retriever is None:
            raise ValueError(f"{what} needs passages to search: give corpus, retriever_url or retriever")
        return self.retriever

    @staticmethod
    def _qa_question(row: QARow) -> Question:
        return Question(row.question, row.data_source, row.golden_answers)


def _walkthrough(question: Question) -> list[str]:
    """The oracle's actions: its searches (the question itself where they are unknown), then a golden answer."""
    searches = question.searches or (question.text,)
    return [f"<search>{query}</search>" for query in searches] + [f"<answer>{question.golden_answers[0]}</answer>"]


_WORLD_KNOBS = tuple(field.name for field in dataclasses.fields(WorldSettings))
_TASK_OPTIONS = (*_WORLD_KNOBS, "question", "golden_answers", "data_source")


class SearchQAEnv(BaseTextEnv):
    """See the module docstring.

    Args:
        num_people, num_companies, num_cities, distractors, families, collect_size: the generated world's knobs
            (`WorldSettings`).
        top_k: passages a search returns.
        anchor: "retrieved" or "observation" (the module docstring).
        qa, corpus, retriever_url, retriever: bring your own data (the module docstring).
        retriever_wait: with `retriever_url`, seconds an outage of the server (a refused connection, a 5xx answer) is
            waited out before a search fails the trajectory (default 300: a server's restart).
        max_steps: the turn limit (4, as the paper's); None for none.

    `reset(seed, options)`: options are None, knobs of the world for this task, or a QA row (`question`,
    `golden_answers`, optionally `data_source`, its task type). `walkthrough`: the oracle's actions; `world`: the
    current generated world (None with QA rows).
    """

    def __init__(self, *, num_people: int = 10, num_companies: int = 4, num_cities: int = 8, distractors: int = 2,
                 families: Sequence[str] = FAMILIES, collect_size: int = 2, top_k: int = 3, anchor: str = "retrieved",
                 qa: str | None = None, corpus: str | None = None, retriever_url: str | None = None,
                 retriever: Retriever | None = None, retriever_wait: float = DEFAULT_SERVICE_WAIT,
                 max_steps: int | None = 4) -> None:
        super().__init__(max_steps=max_steps)
        if not is_int(top_k) or top_k < 1:
            raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
        if anchor not in ANCHORS:
            raise ValueError(f"anchor must be one of {ANCHORS}, got {anchor!r}")
        self.top_k, self.anchor = top_k, anchor
        settings = dict(num_people=num_people, num_companies=num_companies, num_cities=num_cities,
                        distractors=distractors, families=families, collect_size=collect_size)
        self._tasks = _Tasks(settings, qa, corpus, retriever_url, retriever, retriever_wait)
        self._episode: _Episode | None = None
        self._world: World | None = None

    @property
    def walkthrough(self) -> list[str]:
        """The oracle's actions from the start of the current task: the gold searches, then a golden answer."""
        self.require_reset("the walkthrough")
        return _walkthrough(self._episode.question)

    @property
    def world(self) -> World | None:
        """The current task's generated world (None for a QA row)."""
        self.require_reset("the world")
        return self._world

    def _reset(self, seed: int | None, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        unknown = sorted(set(options or {}) - set(_TASK_OPTIONS))
        if unknown:
            raise ValueError(f"SearchQAEnv's task options are {_TASK_OPTIONS}, got {unknown}")
        question, retriever, self._world = self._tasks.task(seed, options or {})
        self._episode = _Episode(question, retriever, self.top_k)
        return question.text, self._info(question.text, None)

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        try:
            kind, text = read_action(action)
        except ValueError as exc:
            observation = f"Invalid action: {exc}. {INVALID_HELP}"
            return observation, 0.0, False, self._info(observation, str(exc))
        if kind == "search":
            observation = self._episode.search(text)
            return observation, 0.0, False, self._info(observation, None)
        won = self._episode.answer(text)
        observation = f"You answered: {text}"
        return observation, 1.0 if won else 0.0, True, self._info(observation, None)

    def _info(self, observation: str, invalid: str | None) -> dict[str, Any]:
        episode = self._episode
        return {
            INFO_ANCHOR: episode.anchor if self.anchor == "retrieved" else observation,
            INFO_TASK: episode.question.text,
            INFO_TASK_TYPE: episode.question.family,
            INFO_WON: episode.won,
            INFO_METRICS: episode.metrics,
            INFO_INVALID_ACTION: invalid,
        }


class SearchQAToolEnv:
    """Search QA as a TRL environment class (`GRPOTrainer(environment_factory=...)`, or `GiGPOTrainer`'s): the same
    tasks as `SearchQAEnv`, with the tools `search` and `answer` instead of tags.

    Built with the knobs and data of `SearchQAEnv` (less `anchor`: its `anchor` property is the "retrieved" rule), e.g.
    `functools.partial(SearchQAToolEnv, collect_size=3)`. `reset(**row)`: the row's `seed` picks the task (or the row
    is a QA row: `question` and `golden_answers`); a row may also set the world's knobs; TRL's `prompt` and other
    columns are ignored. Each tool call takes a turn; after `max_steps` of them, or an answer, the episode is `done`.
    `won` says whether the answer was right, `get_reward()` is 1.0 then, else 0.0.
    """

    def __init__(self, *, top_k: int = 3, qa: str | None = None, corpus: str | None = None,
                 retriever_url: str | None = None, retriever: Retriever | None = None,
                 retriever_wait: float = DEFAULT_SERVICE_WAIT, max_steps: int = 4, **knobs: Any) -> None:
        if not is_int(top_k) or top_k < 1:
            raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
        if not is_int(max_steps) or max_steps < 1:
            raise ValueError(f"max_steps must be an int >= 1, got {max_steps!r}")
        self._top_k, self._max_steps = top_k, max_steps
        self._tasks = _Tasks(knobs, qa, corpus, retriever_url, retriever, retriever_wait)
        self._episode: _Episode | None = None
        self._turns = 0
        self.done = self.won = False

    def reset(self, **row: Any) -> str:
        if "seed" not in row and "question" not in row:
            raise ValueError(f"SearchQAToolEnv.reset needs a `seed` column (or a QA row: `question`, "
                             f"`golden_answers`), got the columns {sorted(row)}")
        options = {name: value for name, value in row.items() if name in _TASK_OPTIONS}
        question, retriever, _ = self._tasks.task(row.get("seed"), options)
        self._episode, self._turns = _Episode(question, retriever, self._top_k), 0
        self.done = self.won = False
        return f" Question: {question.text}"

    def search(self, query: str) -> str:
        """Search the knowledge base.

        Args:
            query: What to search for, e.g. a name.

        Returns:
            The passages found, as <information>Doc 1: ... </information>.
        """
        self._take_turn()
        if not query.strip():
            raise ValueError("The query is empty.")
        return self._episode.search(query)

    def answer(self, answer: str) -> str:
        """Give the final answer to the question; this ends the game.

        Args:
            answer: The answer alone, e.g. a name, a place or a year.

        Returns:
            The answer given.
        """
        self._take_turn()
        if not answer.strip():
            raise ValueError("The answer is empty.")
        self.won = self._episode.answer(answer)
        self.done = True
        return f"You answered: {answer}"

    def get_reward(self) -> float:
        return 1.0 if self.won else 0.0

    @property
    def anchor(self) -> tuple[str, tuple[str, ...]]:
        """The question and the passages retrieved so far (a property: TRL lists no tool for it)."""
        return self._episode.anchor

    def _take_turn(self) -> None:
        if self.done:
            raise ValueError("The game is over.")
        self._turns += 1
        self.done = self._turns >= self._max_steps


# ----------------------------------------------------------------------------------------------------------------------
# Scripted policies.
# ----------------------------------------------------------------------------------------------------------------------

# (question, history of (observation, action) pairs, oldest first, current observation) -> the answer's text
Policy = Callable[[str, Sequence[tuple[str, str]], str], str]


def oracle_policy(question: str, history: Sequence[tuple[str, str]], observation: str) -> str:
    """The gold searches, then the answer, read from every result so far (a generated world's question)."""
    return _scripted_action(question, len(history), [seen for seen, _ in history] + [observation], None)


def memoryless_policy(window: int, cities: Sequence[str], rng: random.Random) -> Policy:
    """The best policy that sees only the question, the step index, the last `window` exchanges and the current
    observation: it searches the entities in order, as the oracle does, and answers from the passages it sees; what it
    no longer sees it guesses as well as it can: a birth city uniformly among the world's `cities`, an unseen birth
    year by `BIRTH_YEARS` (the person whose seen year is nearer the range's start is likelier born earlier)."""
    if not is_int(window) or window < 0:
        raise ValueError(f"window must be an int >= 0, got {window!r}")

    def policy(question: str, history: Sequence[tuple[str, str]], observation: str) -> str:
        shown = list(history)[len(history) - window:] if window else []
        return _scripted_action(question, len(history), [seen for seen, _ in shown] + [observation],
                                lambda: rng.choice(list(cities)))

    return policy


def play(env: SearchQAEnv, seed: int, policy: Policy) -> tuple[list[tuple[Hashable, str]], bool]:
    """Play one episode of task `seed` with `policy`; returns the (anchor, action) of each step and whether it won."""
    observation, info = env.reset(seed=seed)
    history: list[tuple[str, str]] = []
    steps = []
    while True:
        action = policy(info[INFO_TASK], history, observation)
        steps.append((info[INFO_ANCHOR], action))
        history.append((observation, action))
        observation, _, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            return steps, bool(info[INFO_WON])


def _scripted_action(question: str, step: int, seen: Sequence[str], guess_city: Callable[[], str] | None) -> str:
    """The action at `step` of a player who reads the observations `seen` (the current one last)."""
    path = next(((match, PATH_QUESTIONS[kind][3]) for kind, pattern in _PATH_PATTERNS.items()
                 if (match := pattern.fullmatch(question))), None)
    if path is not None:  # each hop's passage is the top result of its search, in the latest observation
        start, facts = path[0].group(1), path[1]
        if step == 0:
            return f"<search>{start}</search>"
        value = next(iter(_passages(seen[-1]).values()), {}).get(facts[step - 1], "unknown")
        return f"<search>{value}</search>" if step < len(facts) else f"<answer>{value}</answer>"
    collect, compare = COLLECT_QUESTION.fullmatch(question), COMPARE_QUESTION.fullmatch(question)
    if collect is None and compare is None:
        raise ValueError(f"not a question of a generated world: {question!r}")
    names = re.split(r", | and ", collect.group(1)) if collect else list(compare.groups())
    if step < len(names):
        return f"<search>{names[step]}</search>"
    known = {name: facts for observation in seen for name, facts in _passages(observation).items()}
    if collect:
        cities = [known.get(name, {}).get("birth_city") or (guess_city() if guess_city else "unknown") for name in names]
        return f"<answer>{_listed(cities)}</answer>"
    # an unseen birth year counts as the range's midpoint: a person seen born before it was likelier born earlier
    years = [float(known.get(name, {}).get("birth_year", sum(BIRTH_YEARS) / 2)) for name in names]
    return f"<answer>{names[0] if years[0] <= years[1] else names[1]}</answer>"


def _passages(observation: str) -> dict[str, dict[str, str]]:
    """The facts of each passage of a search result, by its title, in the result's order."""
    return {title: _facts(body) for title, body in INFORMATION.findall(observation)}


def _facts(body: str) -> dict[str, str]:
    """The facts a passage's text states, read back through the sentences that wrote it."""
    facts: dict[str, str] = {}
    for template in _FACT_SENTENCES:
        match = template.search(body)
        if match:
            facts.update({name: value for name, value in match.groupdict().items() if name not in facts})
    return facts


def _sentence_pattern(template: str) -> re.Pattern[str]:
    """A regular expression that reads a sentence template's fields back (`name` and `other` unnamed)."""
    parts = re.split(r"\{(\w+)\}", template)
    pattern = "".join(re.escape(part) if k % 2 == 0 else
                      (f"(?:{NAME})" if part in ("name", "other") else f"(?P<{part}>{FIELDS.get(part, NAME)})")
                      for k, part in enumerate(parts))
    return re.compile(pattern)


_FACT_SENTENCES = [_sentence_pattern(template) for sentences in (PERSON_SENTENCES, COMPANY_SENTENCES, CITY_SENTENCES)
                   for choices in sentences for template in choices]
