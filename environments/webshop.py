"""WebShop (Yao et al., 2022), the benchmark the GiGPO paper leads with: an agent shops for a product that fits an
instruction, searching and clicking through a web shop's pages, and is scored on what it buys.

**The protocol, as WebShop's users know it.** Two actions: `search[keywords]`, from any page, and `click[element]`,
among the page's clickables (the argument is lower-cased; the search page's own `click[search]` does nothing, as in
WebShop). Anything else is a no-op turn: nothing changes, the reward is 0, and `info["invalid_action"]` says why.
Pages: search; results (the top `search_results` (50) hits of a search, `results_per_page` (10) a page: `back to
search`, `< prev` from page 2 on, `next >` always, even past the last hit, then the page's product ids); item (`back
to search`, `< prev`, every option value, `description`, `features`, `reviews`, `buy now`); the item's sub-pages
(`back to search`, `< prev`); done. Each page's observation is WebShop's 'text' form, its visible strings joined with
" [SEP] " (`Instruction: [SEP] i need ... [SEP] Back to Search [SEP] Page 1 (Total results: 50) [SEP] Next > [SEP]
B0... [SEP] <title> [SEP] $15.99 [SEP] ...`), so a prompt or parser written for WebShop or verl-agent carries over;
clicking an option leaves the item page's text as it is (WebShop sets it in the browser). `info["admissible_actions"]`
lists them as verl-agent does: `search[<your query>]` on the search page, then `click[<clickable>]` for each
clickable.

**The reward of a purchase** (`click[buy now]` ends the episode) is WebShop's (`purchase_reward`): the type factor
times (attributes matched + options matched + [price <= the goal's bound]) / (goal attributes + goal options + 1). A
goal attribute matches a product attribute whose fuzzy token-set ratio with it exceeds 85 (rapidfuzz, processed as
thefuzz's `full_process`), or a substring of the title, bullet points or description; options are compared after
colour normalisation, ratio > 85, a synthetic goal's options as the (name, value) pairs WebShop's code compares; the
type factor is 1, lowered to 0.5 / 0.1 / 0 when neither the query nor two levels of the category path match and few of
the goal name's nouns appear in the title. Those nouns come from spaCy's `en_core_web_sm` where it is installed
(WebShop's tags: NOUN, PROPN); without it (no registry here serves it) every word of two letters or more that is not
a stopword or a number stands for a noun. That differs from WebShop only where the bought title is not the goal's
own: buying the goal's product scores the same either way (every noun of a title is in itself), so success is
unchanged; a wrong purchase's partial reward can move by the type factor (one of 1, 0.5, 0.1, 0). **Success is a
reward of exactly 1.0** (`info["won"]`); `info["metrics"]["score"]` is 100 x the reward (the paper's score, 0 without a
purchase). `reward="success"` pays 1.0 for a success and 0 otherwise (verl-agent pays 10, which the normalised
advantages do not tell apart).

**Search** is BM25 through bm25s with Lucene's scoring and pyserini's parameters (k1 0.9, b 0.4), Porter stemming
(PyStemmer) and Lucene's English stopwords, over WebShop's document text of each product (its title, description,
first bullet point and option values, lower-cased); ties go to the earlier product. WebShop's own search is pyserini's
Lucene; bm25s keeps one-letter tokens out and tokenizes on words, so rankings can differ in the details. The index is
built once per machine (the first worker that needs it, under a file lock) and memory-mapped by every worker.

**Two sources of products.**
- A shop generated from `shop_seed` (default): `num_products` products of ten product types in five categories,
  grouped in families: a target (a possible goal's product) and `distractors` near misses that differ from it in one
  attribute, in one option group (none of the target's values) or in the price (above any bound a goal on the target
  gets), so that which item is clicked on a results page decides the outcome. A task's seed picks a family's target,
  one value of each of its `options_per_product` option groups and a price bound, and writes the goal as WebShop
  writes synthetic goals: `<instruction> with <option>: <value>, and ... , and price lower than XX.00 dollars`, the
  bound drawn from the 10-dollar grid above the price. `walkthrough`: the oracle's actions.
- WebShop's data, for users who have it (`items`, `attributes`, optionally `human_instructions`; or `documents`, the
  `documents.jsonl` its search engine indexes): read WebShop's way, with synthetic goals (one per combination of a
  product's options) or human goals (`human_goals=True`), the prices of price ranges and the goals' price bounds drawn
  from a fixed seed (WebShop draws them unseeded), and the goals shuffled with WebShop's fixed seed, after which the
  canonical split holds for every process: the first 500 goals `test`, the next 1,000 `dev`, the rest `train`
  (`fold_seeds`). A task's seed is a goal's index.

**Anchors.** `anchor="state"` (default): the exact page state (page kind, query, page number, item, the options chosen
so far, sub-page), so two copies on the same results page share a step group, and an item page before and after an
option is chosen do not. `anchor="observation"`: verl-agent's rule, the page's text after the instruction (each
string quoted), which cannot tell an item page's options apart.

`WebShopToolEnv` is the same task as a TRL environment class, with the tools `search` and `click`. `greedy_policy`
(search the instruction, buy the first result) and the walkthrough are scripted players; `play` runs one.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import itertools
import json
import random
import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gigpo_trl.env_base import BaseTextEnv, is_int
from gigpo_trl.environments.retrieval import Analyzer, BM25Retriever
from gigpo_trl.envs import (
    INFO_ADMISSIBLE_ACTIONS, INFO_ANCHOR, INFO_METRICS, INFO_TASK, INFO_TASK_TYPE, INFO_WON, default_fold_seeds,
)
from gigpo_trl.paths import cache_root
from gigpo_trl.prompts import PromptTemplate

SEARCH_RESULTS = 50
RESULTS_PER_PAGE = 10
BACK_TO_SEARCH, NEXT_PAGE, PREV_PAGE, BUY_NOW, SEARCH = "Back to Search", "Next >", "< Prev", "Buy Now", "Search"
SUB_PAGES = ("Description", "Features", "Reviews")
ANCHORS = ("state", "observation")
REWARDS = ("score", "success")
INFO_INVALID_ACTION = "invalid_action"
SEARCH_PLACEHOLDER = "search[<your query>]"
# What WebShop's Lucene index skips (Lucene's English stop set), and pyserini's BM25 parameters.
LUCENE_STOPWORDS = ("a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "if", "in", "into", "is", "it", "no",
                    "not", "of", "on", "or", "such", "that", "the", "their", "then", "there", "these", "they", "this",
                    "to", "was", "will", "with")
ANALYZER = Analyzer(stopwords=LUCENE_STOPWORDS, stemmer="porter", k1=0.9, b=0.4)
PRICE_GRID = tuple(10.0 * i for i in range(1, 100))  # the goals' price bounds, as WebShop's
NO_PRICE_BOUND = 1_000_000.0  # WebShop's bound where the grid above a price has fewer than two points
MISSING_PRICE = 100.0  # WebShop's price of a product whose pricing is empty
PRICE_SEED, GOAL_SHUFFLE_SEED = 0, 233  # fixed here (WebShop draws prices unseeded); its goal shuffle's seed
SPLIT = {"test": (0, 500), "dev": (500, 1500)}  # the canonical split of WebShop's goals; the rest is "train"
# WebShop's colour normalisation (`normalize.py`): the first of these contained in an option's text stands for it.
COLOR_SET = (
    "alabaster", "apricot", "aqua", "ash", "asphalt", "azure", "banana", "beige", "black", "blue", "blush", "bordeaux",
    "bronze", "brown", "burgundy", "camel", "camo", "caramel", "champagne", "charcoal", "cheetah", "chestnut",
    "chocolate", "christmas", "coffee", "cognac", "copper", "coral", "cranberry", "cream", "crystal", "dark", "denim",
    "eggplant", "elephant", "espresso", "fuchsia", "gold", "granite", "grape", "graphite", "grass", "gray", "green",
    "grey", "heather", "indigo", "ivory", "ivy", "khaki", "lavender", "lemon", "leopard", "light", "lilac", "lime",
    "magenta", "maroon", "mauve", "merlot", "midnight", "mint", "mocha", "multicolor", "mushroom", "mustard", "natural",
    "navy", "nude", "olive", "orange", "peach", "pewter", "pink", "plum", "purple", "rainbow", "red", "rose", "royal",
    "rust", "sand", "sapphire", "seashell", "silver", "skull", "slate", "steel", "stone", "stonewash", "sunflower",
    "tan", "taupe", "teal", "tiger", "turquoise", "violet", "walnut", "wheat", "white", "wine", "yellow",
)


# --------------------------------------------------------------------------------------------
# Products, goals and WebShop's reward.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Product:
    """A product as WebShop shows and scores it: `pricing` is one price or a (low, high) range; `options` maps each
    option group's name to its values (lower case); `attributes` are what goal attributes are matched against."""

    asin: str
    title: str
    category: str
    query: str
    product_category: str
    description: str
    bullet_points: tuple[str, ...]
    pricing: tuple[float, ...]
    options: Mapping[str, tuple[str, ...]]
    attributes: tuple[str, ...]

    @property
    def price_tag(self) -> str:
        """The price as pages show it: `$15.99`, or `$12.99 to $19.99` for a range (WebShop's float formatting)."""
        return f"${self.pricing[0]}" if len(self.pricing) == 1 else f"${self.pricing[0]} to ${self.pricing[1]}"

    @property
    def document(self) -> str:
        """WebShop's search text of the product: title, description, first bullet point, options, lower-cased."""
        options = ", and ".join(f"{name}: {', '.join(values)}" for name, values in self.options.items())
        bullet = self.bullet_points[0] if self.bullet_points else ""
        return " ".join([self.title, self.description, bullet, options]).lower()


@dataclass(frozen=True)
class Goal:
    """What a task asks for: the product `asin` it was written from, its `instruction`, the `attributes` and
    `options` a purchase must match (a synthetic goal's options are (name, value) pairs, a human goal's the values'
    texts), the price bound, and what the type factor compares (`name`, `query`, `category`, `product_category`)."""

    asin: str
    instruction: str
    attributes: tuple[str, ...]
    options: tuple[tuple[str, str] | str, ...]
    price_upper: float
    name: str
    query: str
    category: str
    product_category: str


@dataclass(frozen=True)
class PurchaseReward:
    """WebShop's reward of a purchase and its parts."""

    reward: float
    type_factor: float
    attributes_matched: int
    options_matched: int
    price_ok: bool
    title_score: float


def _ascii_dammit(value: Any) -> str:
    """thefuzz's `asciidammit`: the text of `value` (str() of anything else, as of a (name, value) pair) without the
    characters 128-255."""
    return "".join(character for character in str(value) if not 128 <= ord(character) < 256)


def fuzzy_ratio(first: Any, second: Any) -> int:
    """thefuzz's `token_set_ratio` (WebShop's matcher) through rapidfuzz: both texts processed as thefuzz's
    `full_process` does (non-alphanumerics to spaces, lower case, trimmed; 0 where either is then empty), the ratio
    rounded to an int as thefuzz rounds it (a ratio of 85.2 does not exceed 85)."""
    from rapidfuzz import fuzz, utils  # noqa: PLC0415 (a dependency of the package, imported where matching runs)

    return int(round(fuzz.token_set_ratio(_ascii_dammit(first), _ascii_dammit(second), processor=utils.default_process)))


def normalize_color(option: str | tuple[str, str]) -> str | tuple[str, str]:
    """WebShop's colour normalisation: the first colour of `COLOR_SET` in the option (a substring of a text; an element
    of a (name, value) pair), else the option as it is."""
    return next((color for color in COLOR_SET if color in option), option)


@functools.cache
def _spacy_tagger() -> Callable[[str], list[str]] | None:
    """spaCy's `en_core_web_sm` noun tagger where the model is installed, else None."""
    try:
        import spacy  # noqa: PLC0415 (optional)

        nlp = spacy.load("en_core_web_sm")
    except (ImportError, OSError):
        return None
    return lambda text: [token.text.lower() for token in nlp(text) if token.pos_ in ("PNOUN", "NOUN", "PROPN")]


_WORD = re.compile(r"[a-z][a-z'-]+")


def title_nouns(title: str) -> list[str]:
    """The nouns of a title the type factor compares: spaCy's tags where `en_core_web_sm` is installed, else every word
    of two letters or more that is not one of `LUCENE_STOPWORDS` (see the module docstring)."""
    tagger = _spacy_tagger()
    if tagger is not None:
        return tagger(title)
    return [word for word in _WORD.findall(title.lower()) if word not in LUCENE_STOPWORDS]


def purchase_reward(product: Product, price: float, chosen: Mapping[str, str], goal: Goal,
                    nouns: Callable[[str], list[str]] = title_nouns) -> PurchaseReward:
    """WebShop's reward (`goal.py`'s `get_reward`) of buying `product` at `price` with the options `chosen` (group name
    -> value) for `goal`: type factor x (attributes matched + options matched + [price <= bound]) / (goal attributes +
    goal options + 1)."""
    query_match = product.query == goal.query
    levels = {level.strip() for level in product.product_category.split("›")}
    category_match = len(levels & {level.strip() for level in goal.product_category.split("›")}) >= 2
    bought, desired = nouns(product.title), nouns(goal.name)
    title_score = len(set(bought) & set(desired)) / len(desired) if desired else 0.2
    type_factor = 1.0 if query_match or category_match or title_score > 0.2 else 0.5
    if title_score < 0.1:
        type_factor = 0.1
    if title_score == 0.0:
        type_factor = 0.0

    texts = (product.title.lower(), " ".join(product.bullet_points).lower(), product.description.lower())
    attributes = sum(any(fuzzy_ratio(have, wanted) > 85 for have in product.attributes) or
                     any(wanted in text for text in texts) for wanted in goal.attributes)
    picked = [normalize_color(value) for value in chosen.values()]
    options = sum(any(fuzzy_ratio(have, normalize_color(wanted)) > 85 for have in picked) for wanted in goal.options)
    price_ok = price <= goal.price_upper
    total = (attributes + options + price_ok) / (len(goal.attributes) + len(goal.options) + 1)
    return PurchaseReward(total * type_factor, type_factor, attributes, options, price_ok, title_score)


def price_bound(price: float, rng: random.Random) -> float:
    """A goal's price bound, as WebShop draws it: the larger of two of the first four grid points above the price
    (`NO_PRICE_BOUND` where there are fewer than two)."""
    above = [point for point in PRICE_GRID if point > price][:4]
    return max(rng.sample(above, 2)) if len(above) >= 2 else NO_PRICE_BOUND


def synthetic_instruction(instruction: str, options: Sequence[tuple[str, str]], price_upper: float) -> str:
    """A synthetic goal's text, as WebShop writes it: `<instruction> with <option>: <value>, and ..., and price lower
    than XX.00 dollars` (no price part where there is no bound)."""
    option_text = " with " + ", and ".join(f"{name}: {value}" for name, value in options) if options else ""
    price_text = f", and price lower than {price_upper:.2f} dollars" if price_upper != NO_PRICE_BOUND else ""
    return f"{instruction}{option_text}{price_text}"


# --------------------------------------------------------------------------------------------
# A catalogue: products, their prices, goals, and the search over them.
# --------------------------------------------------------------------------------------------


@dataclass
class Catalogue:
    """The products of a shop (by asin, in corpus order), the price each is sold at, its goals (a task's seed is an
    index into `goals`, or picks one through `goal_of`), the fold of each goal index where the source has folds, and
    the search over it."""

    products: dict[str, Product]
    prices: dict[str, float]
    goal_of: Callable[[int], Goal]
    num_goals: int | None  # None: every int seed has a goal (a generated shop)
    folds: dict[str, range] | None
    search_index: BM25Retriever
    source: str

    def search(self, keywords: str, k: int) -> list[str]:
        """The asins of the top `k` products for the keywords, best first."""
        (passages,) = self.search_index([keywords], k)
        return [passage.id for passage in passages]


def _indexed(products: Sequence[Product], key: str) -> BM25Retriever:
    """BM25 over the products' documents, indexed once per machine: the corpus is written under the cache folder
    (`webshop/<key>/corpus.jsonl`, under a file lock) and indexed by `BM25Retriever.from_corpus_file`."""
    folder = cache_root() / "webshop" / key
    corpus = folder / "corpus.jsonl"
    if not corpus.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "corpus.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not corpus.is_file():
                staging = corpus.with_suffix(".partial")
                staging.write_text("".join(json.dumps({"id": product.asin, "contents": product.document}) + "\n"
                                           for product in products))
                staging.replace(corpus)
    return BM25Retriever.from_corpus_file(corpus, analyzer=ANALYZER)


# --------------------------------------------------------------------------------------------
# The generated shop.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProductType:
    """A kind of product the generator makes: its name (as titles and queries say it), WebShop's category and
    category path, the attributes its products draw from (no word shared between two), its option groups, and its
    price range."""

    name: str
    category: str
    path: str
    attributes: tuple[str, ...]
    options: tuple[tuple[str, tuple[str, ...]], ...]
    price_range: tuple[float, float]


# Option values that are not colours hold none of `COLOR_SET`'s words: WebShop's normalisation would turn one into
# that colour ("standard" into "tan") and no purchase could match it.
COLORS = ("black", "white", "navy", "red", "green", "grey", "beige", "pink", "purple", "brown", "orange", "yellow",
          "teal", "olive", "ivory", "silver")
SIZES = ("small", "medium", "large", "xl", "xxl", "3xl")  # none a word of another: WebShop matches "large" to "x-large"
PRODUCT_TYPES = (
    ProductType("face serum", "beauty", "Beauty & Personal Care › Skin Care › Face › Serums",
                ("hyaluronic acid", "fragrance free", "oil control", "anti aging", "pump bottle", "dermatologist tested",
                 "sensitive skin", "paraben safe"),
                (("scent", ("lavender", "citrus", "unscented", "cucumber", "jasmine", "vanilla")),
                 ("pack", ("single", "twin", "triple", "family"))), (12.0, 45.0)),
    ProductType("shampoo", "beauty", "Beauty & Personal Care › Hair Care › Shampoo & Conditioner › Shampoos",
                ("sulfate free", "color safe", "dry scalp", "argan oil", "curly hair", "tea tree", "salon quality",
                 "daily use"),
                (("scent", ("coconut", "mint", "almond", "unscented", "eucalyptus", "honey")),
                 ("size", ("8 ounce", "16 ounce", "32 ounce", "64 ounce"))), (6.0, 30.0)),
    ProductType("running shoes", "fashion", "Clothing, Shoes & Jewelry › Men › Shoes › Athletic › Running",
                ("non slip", "memory foam", "rubber sole", "lace up", "machine washable", "wide toe", "breathable mesh",
                 "arch support"),
                (("color", COLORS), ("size", ("7", "8", "9", "10", "11", "12"))), (35.0, 120.0)),
    ProductType("hoodie", "fashion", "Clothing, Shoes & Jewelry › Women › Clothing › Fashion Hoodies & Sweatshirts",
                ("long sleeve", "fleece lined", "drawstring hood", "relaxed fit", "kangaroo pocket", "cotton blend",
                 "quick drying", "zip front"),
                (("color", COLORS), ("size", SIZES)), (18.0, 60.0)),
    ProductType("protein bar", "grocery", "Grocery & Gourmet Food › Snacks & Sweets › Nutrition Bars › Protein Bars",
                ("gluten free", "low sugar", "plant based", "high fiber", "keto friendly", "whey isolate",
                 "non gmo", "individually wrapped"),
                (("flavor", ("chocolate", "peanut butter", "cookie dough", "strawberry", "caramel", "coconut")),
                 ("pack", ("12 count", "15 count", "20 count", "24 count"))), (10.0, 40.0)),
    ProductType("green tea", "grocery", "Grocery & Gourmet Food › Beverages › Tea › Green Tea",
                ("caffeine free", "loose leaf", "usda organic", "cold brew", "single origin", "bulk bag",
                 "antioxidant rich", "sugar added"),
                (("flavor", ("jasmine", "matcha", "ginger", "hibiscus", "peach", "plain")),
                 ("pack", ("20 bags", "50 bags", "100 bags", "200 bags"))), (5.0, 28.0)),
    ProductType("bluetooth speaker", "electronics", "Electronics › Portable Audio & Video › Portable Speakers",
                ("water resistant", "long battery", "stereo pairing", "built microphone", "deep bass", "usb charging",
                 "compact design", "voice assistant"),
                (("color", COLORS), ("style", ("mini", "regular", "pro", "max"))), (20.0, 150.0)),
    ProductType("phone charger", "electronics", "Electronics › Accessories › Chargers & Power Adapters",
                ("fast charging", "dual port", "foldable plug", "overheat protection", "braided cable",
                 "travel friendly", "universal compatible", "wall mount"),
                (("color", COLORS), ("style", ("one port", "two port", "three port", "four port"))), (8.0, 40.0)),
    ProductType("bookshelf", "furniture", "Home & Kitchen › Furniture › Home Office Furniture › Bookcases",
                ("solid wood", "easy assembly", "adjustable shelves", "wall anchor", "industrial style", "space saving",
                 "open back", "scratch resistant"),
                (("color", COLORS), ("size", ("3 tier", "4 tier", "5 tier", "6 tier"))), (40.0, 190.0)),
    ProductType("throw pillow", "furniture", "Home & Kitchen › Bedding › Decorative Pillows › Throw Pillow Covers",
                ("hidden zipper", "velvet fabric", "double sided", "insert included", "hypoallergenic filling",
                 "pet friendly", "boho pattern", "square shape"),
                (("color", COLORS), ("size", ("16 inch", "18 inch", "20 inch", "22 inch"))), (9.0, 38.0)),
)
INSTRUCTIONS = (  # {a}: "a ", "an " or nothing (a plural type)
    "i am looking for {a}{type} that is {x} and {y}",
    "i need {a}{x} {type} that is {y}",
    "find me {a}{type} which is {x} and {y}",
    "i want {a}{x} and {y} {type}",
)
BRAND_SYLLABLES = ("vel", "mor", "kan", "tri", "lox", "sen", "dar", "vio", "pel", "zum", "hav", "rin", "cor", "bel",
                   "nox", "tal", "fen", "quo", "jus", "wex")
DISTRACTOR_KINDS = ("attribute", "option", "price")


@dataclass(frozen=True)
class ShopSettings:
    """The knobs of a generated shop: `num_products` in all (families of a target and `distractors` near misses),
    `options_per_product` option groups each (0, 1 or 2; a group offers 3 to 4 values), and the `shop_seed` it is
    generated from."""

    num_products: int = 1000
    distractors: int = 3
    options_per_product: int = 1
    shop_seed: int = 0

    def __post_init__(self) -> None:
        if not is_int(self.distractors) or self.distractors < 0:
            raise ValueError(f"distractors must be an int >= 0, got {self.distractors!r}")
        if not is_int(self.num_products) or self.num_products < 1 + self.distractors:
            raise ValueError(f"num_products must be an int of at least one family (1 + distractors = "
                             f"{1 + self.distractors}), got {self.num_products!r}")
        if self.options_per_product not in (0, 1, 2):
            raise ValueError(f"options_per_product must be 0, 1 or 2, got {self.options_per_product!r}")
        if not is_int(self.shop_seed):
            raise ValueError(f"shop_seed must be an int, got {self.shop_seed!r}")

    @property
    def num_families(self) -> int:
        return self.num_products // (1 + self.distractors)


@dataclass(frozen=True)
class Family:
    """A target product, the instruction its goals start from (with the two attributes it names), and its near
    misses."""

    target: Product
    instruction: str
    goal_attributes: tuple[str, str]
    distractors: tuple[Product, ...]


def _brand(rng: random.Random) -> str:
    return "".join(rng.sample(BRAND_SYLLABLES, 2)).capitalize() + rng.choice(("a", "o", "ix", "en", "ra"))


def _asin(rng: random.Random) -> str:
    return "B0" + "".join(rng.choices("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=8))


def _product(rng: random.Random, kind: ProductType, attributes: Sequence[str], options: Mapping[str, tuple[str, ...]],
             pricing: tuple[float, ...]) -> Product:
    brand = _brand(rng)
    title = f"{brand} {kind.name.title()} - {', '.join(attribute.title() for attribute in attributes)}"
    bullets = (*(f"{attribute.capitalize()}." for attribute in attributes), f"Made by {brand}.")
    return Product(_asin(rng), title, kind.category, kind.name, kind.path, f"A {kind.name} by {brand}.", bullets,
                   pricing, dict(options), tuple(attributes))


def _family(rng: random.Random, kind: ProductType, settings: ShopSettings) -> Family:
    attributes = rng.sample(kind.attributes, 3)
    groups = rng.sample(kind.options, settings.options_per_product)
    # 3 or 4 values a group, two at least left out (the values an option near miss offers instead)
    options = {name: tuple(rng.sample(values, min(rng.choice((3, 4)), len(values) - 2))) for name, values in groups}
    price = float(rng.randint(int(kind.price_range[0]), int(kind.price_range[1]))) + 0.99
    pricing = (price,) if rng.random() < 0.8 else (price, round(price + rng.randint(3, 9), 2))
    target = _product(rng, kind, attributes, options, pricing)
    x, y = attributes[:2]
    template = rng.choice(INSTRUCTIONS)
    following = x if "{a}{x}" in template else kind.name
    article = "" if kind.name.endswith("s") else "an " if following[0] in "aeiou" else "a "
    instruction = template.format(a=article, type=kind.name, x=x, y=y)
    near = []
    for kind_of_miss in itertools.islice(itertools.cycle(DISTRACTOR_KINDS), settings.distractors):
        if kind_of_miss == "option" and not groups:
            kind_of_miss = "attribute"
        miss_attributes, miss_options, miss_pricing = list(attributes), dict(options), pricing
        if kind_of_miss == "attribute":  # one of the goal's attributes replaced by one the target lacks
            others = [attribute for attribute in kind.attributes if attribute not in attributes]
            miss_attributes[rng.randrange(2)] = rng.choice(others)
        elif kind_of_miss == "option":  # a group's values all other than the target's: none a goal on it asks for
            name, values = rng.choice(groups)
            rest = [value for value in values if value not in options[name]]
            miss_options[name] = tuple(rng.sample(rest, min(len(rest), len(options[name]))))
        else:  # above every bound a goal on the target gets (the fourth grid point above its price, at most 49 above
            # the range's low end)
            raise_by = rng.randint(60, 90)
            miss_pricing = tuple(round(value + raise_by, 2) for value in pricing)
        near.append(_product(rng, kind, miss_attributes, miss_options, miss_pricing))
    return Family(target, instruction, (x, y), tuple(near))


@functools.cache
def generate_shop(settings: ShopSettings) -> tuple[tuple[Family, ...], tuple[Product, ...], dict[str, float]]:
    """The families of a generated shop, every product in corpus order (shuffled: a target is not always first among
    products that tie), and the price each is sold at (a range's drawn within it)."""
    rng = random.Random(f"webshop-shop-{settings.shop_seed}")
    families = tuple(_family(rng, PRODUCT_TYPES[f % len(PRODUCT_TYPES)], settings)
                     for f in range(settings.num_families))
    products = [product for family in families for product in (family.target, *family.distractors)]
    rng.shuffle(products)
    prices = {product.asin: round(rng.uniform(*product.pricing), 2) if len(product.pricing) == 2 else product.pricing[0]
              for product in products}
    return families, tuple(products), prices


def generated_goal(settings: ShopSettings, families: Sequence[Family], prices: Mapping[str, float], seed: int) -> Goal:
    """The goal of task `seed` on a generated shop: a family's target, one value of each of its option groups, a price
    bound from the grid above its price (see the module docstring)."""
    rng = random.Random(f"webshop-goal-{settings.shop_seed}-{seed}")
    family = families[rng.randrange(len(families))]
    target = family.target
    options = tuple((name, rng.choice(values)) for name, values in sorted(target.options.items()))
    upper = price_bound(prices[target.asin], rng)
    return Goal(target.asin, synthetic_instruction(family.instruction, options, upper), family.goal_attributes,
                options, upper, target.title, target.query, target.category, target.product_category)


@functools.cache
def generated_catalogue(settings: ShopSettings) -> Catalogue:
    """A generated shop as a catalogue (built once per process; its search index once per machine)."""
    families, products, prices = generate_shop(settings)
    key = hashlib.sha256(repr(("generated", dataclasses.astuple(settings))).encode()).hexdigest()[:20]
    return Catalogue({product.asin: product for product in products}, prices,
                     functools.partial(generated_goal, settings, families, prices), None, None,
                     _indexed(products, key), f"a shop generated from seed {settings.shop_seed}")


# --------------------------------------------------------------------------------------------
# WebShop's own data.
# --------------------------------------------------------------------------------------------


def _read_json(path: str | Path, what: str) -> Any:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file ({what})")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc.msg}, line {exc.lineno}); {what} must be a JSON file") from None


def _pricing(raw: Any, where: str) -> tuple[float, ...]:
    """WebShop's pricing of a raw product (`"$12.99"`, `"$12.99 - $19.99"`, a list of numbers, or "" for none:
    `MISSING_PRICE`, as WebShop takes it)."""
    if isinstance(raw, list) and raw and all(isinstance(value, int | float) for value in raw):
        return tuple(float(value) for value in raw[:2])
    if isinstance(raw, str):
        if not raw.strip():
            return (MISSING_PRICE,)
        try:
            values = [float(re.sub(r"[^\d.]", "", part)) for part in raw.split("$")[1:]]
        except ValueError:
            values = []
        if values:
            return tuple(values[:2])
    raise ValueError(f"{where}: its pricing {raw!r} is not a price ('$12.99'), a range ('$12.99 - $19.99') or empty")


def _raw_product(raw: Any, attributes: Mapping[str, Any], where: str) -> Product:
    """A product of `items_shuffle*.json`, read WebShop's way (`engine.py`'s `load_products`)."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: a product must be a JSON object, got {type(raw).__name__}")
    asin = raw.get("asin")
    if not isinstance(asin, str) or not asin:
        raise ValueError(f"{where}: a product needs an `asin`")
    where = f"{where} ({asin})"
    title = raw.get("name")
    if not isinstance(title, str) or not title.strip():
        raise ValueError(f"{where}: a product needs a title (`name`)")
    if "pricing" not in raw:
        raise ValueError(f"{where}: a product needs `pricing` (a price, a range, or \"\" for WebShop's $100.0)")
    bullets = raw.get("small_description") or []
    options = {}
    for name, contents in (raw.get("customization_options") or {}).items():
        if contents is not None:
            options[name.lower()] = tuple(str(item["value"]).strip().replace("/", " | ").lower() for item in contents)
    return Product(asin, title, str(raw.get("category", "")), str(raw.get("query", "")).lower().strip(),
                   str(raw.get("product_category", "")), str(raw.get("full_description") or ""),
                   tuple(bullets) if isinstance(bullets, list) else (str(bullets),), _pricing(raw["pricing"], where),
                   options, tuple(attributes.get(asin, {}).get("attributes") or ("DUMMY_ATTR",)))


def _document_product(line: Any, where: str) -> Product:
    """A product of WebShop's search-engine `documents.jsonl` (its processed fields under `product`)."""
    product = line.get("product") if isinstance(line, dict) else None
    if not isinstance(product, dict):
        raise ValueError(f"{where}: a documents.jsonl line needs `product`, the product's fields")
    asin = product.get("asin")
    if not isinstance(asin, str) or not asin:
        raise ValueError(f"{where}: a product needs an `asin`")
    title = product.get("Title") or product.get("name")
    if not isinstance(title, str) or not title.strip():
        raise ValueError(f"{where} ({asin}): a product needs a title (`Title`)")
    if "pricing" not in product:
        raise ValueError(f"{where} ({asin}): a product needs `pricing`")
    options = {name: tuple(values) for name, values in (product.get("options") or {}).items()}
    return Product(asin, title, str(product.get("category", "")), str(product.get("query", "")).lower().strip(),
                   str(product.get("product_category", "")), str(product.get("Description") or ""),
                   tuple(product.get("BulletPoints") or ()), _pricing(product["pricing"], f"{where} ({asin})"), options,
                   tuple(product.get("Attributes") or ("DUMMY_ATTR",)))


def read_products(items: str | Path | None, attributes: str | Path | None,
                  documents: str | Path | None = None) -> list[Product]:
    """The products of WebShop's files, in their order, each asin once: `items` (`items_shuffle*.json`) with
    `attributes` (`items_ins_v2*.json`), or `documents` (a search engine's `documents.jsonl`, whose products carry
    their attributes).

    Raises:
        FileNotFoundError, ValueError: naming the file and the entry (a product without a title or pricing, a line
            that is not JSON).
    """
    if (items is None) == (documents is None):
        raise ValueError("give WebShop's products one way: items (items_shuffle*.json, with attributes) or documents "
                         "(a documents.jsonl of its search engine)")
    products, seen = [], set()
    if items is not None:
        if attributes is None:
            raise ValueError("items needs attributes (items_ins_v2*.json), which holds the products' attributes")
        annotated = _read_json(attributes, "the attributes file, items_ins_v2*.json")
        raw = _read_json(items, "the products file, items_shuffle*.json")
        if not isinstance(raw, list):
            raise ValueError(f"{items}: the products file must hold a JSON list of products")
        for index, entry in enumerate(raw):
            asin = entry.get("asin") if isinstance(entry, dict) else None
            if asin == "nan" or (isinstance(asin, str) and len(asin) > 10) or asin in seen:
                continue  # WebShop skips these
            products.append(_raw_product(entry, annotated, f"{items}, product {index}"))
            seen.add(asin)
        return products
    path = Path(documents)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (documents.jsonl of WebShop's search engine)")
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}, line {number}: not JSON ({exc.msg})") from None
        product = _document_product(entry, f"{path}, line {number}")
        if product.asin not in seen:
            products.append(product)
            seen.add(product.asin)
    return products


def webshop_goals(products: Sequence[Product], annotations: Mapping[str, Any], prices: Mapping[str, float],
                  rng: random.Random, human: Mapping[str, Any] | None = None) -> list[Goal]:
    """WebShop's goals, in its order: synthetic ones (`human` None), one per combination of the options of each product
    the annotations give an `instruction`; or human ones, one per crowd-sourced instruction with attributes. The price
    bounds are drawn from `rng`."""
    goals = []
    for product in products:
        if human is not None:
            for entry in human.get(product.asin) or []:
                if not entry.get("instruction_attributes"):
                    continue
                upper = price_bound(prices[product.asin], rng)
                text = entry["instruction"].strip(".")
                goals.append(Goal(product.asin, synthetic_instruction(text, (), upper), tuple(entry["instruction_attributes"]),
                                  tuple(entry.get("instruction_options") or ()), upper, product.title, product.query,
                                  product.category, product.product_category))
            continue
        annotation = annotations.get(product.asin) or {}
        if not annotation.get("instruction"):
            continue
        upper = price_bound(prices[product.asin], rng)
        names = sorted(product.options)
        for values in itertools.product(*(product.options[name] for name in names)):
            options = tuple(zip(names, values))
            goals.append(Goal(product.asin, synthetic_instruction(annotation["instruction"], options, upper),
                              tuple(annotation.get("instruction_attributes") or ()), options, upper, product.title,
                              product.query, product.category, product.product_category))
    return goals


@functools.cache
def webshop_catalogue(items: str | None, attributes: str | None, human_instructions: str | None, human_goals: bool,
                      documents: str | None) -> Catalogue:
    """WebShop's data as a catalogue (read once per process; its search index built once per machine), its goals in
    the canonical split (see the module docstring)."""
    products = read_products(items, attributes, documents)
    annotations = _read_json(attributes, "the attributes file, items_ins_v2*.json") if attributes else {}
    if documents is not None and attributes is None:
        annotations = {}
    rng = random.Random(PRICE_SEED)
    prices = {product.asin: rng.uniform(*product.pricing) if len(product.pricing) == 2 else product.pricing[0]
              for product in products}
    human = None
    if human_goals:
        if human_instructions is None:
            raise ValueError("human_goals needs human_instructions (items_human_ins.json)")
        human = _read_json(human_instructions, "the human instructions file, items_human_ins.json")
    goals = webshop_goals(products, annotations, prices, rng, human)
    if not goals:
        raise ValueError(f"no goals in {items or documents}: no product has an instruction in "
                         f"{human_instructions if human_goals else attributes} (synthetic goals come from "
                         "items_ins_v2*.json's `instruction`, human ones from items_human_ins.json)")
    random.Random(GOAL_SHUFFLE_SEED).shuffle(goals)
    folds = {fold: range(min(start, len(goals)), min(end, len(goals))) for fold, (start, end) in SPLIT.items()}
    folds["train"] = range(min(SPLIT["dev"][1], len(goals)), len(goals))
    digest = hashlib.sha256()
    for path in (items, attributes, documents):
        if path is not None:
            digest.update(Path(path).read_bytes())
    return Catalogue({product.asin: product for product in products}, prices, goals.__getitem__, len(goals), folds,
                     _indexed(products, "data-" + digest.hexdigest()[:20]), str(items or documents))


# --------------------------------------------------------------------------------------------
# A session: one episode's pages.
# --------------------------------------------------------------------------------------------


class _Session:
    """One episode in the shop: the goal, the page it is on, and what WebShop's session keeps (the search, the page
    number, the item, the options chosen)."""

    def __init__(self, catalogue: Catalogue, goal: Goal, search_results: int, results_per_page: int) -> None:
        self.catalogue, self.goal = catalogue, goal
        self.search_results, self.results_per_page = search_results, results_per_page
        self.page, self.keywords, self.page_number = "search", None, 1
        self.results: list[str] = []
        self.asin: str | None = None
        self.options: dict[str, str] = {}
        self.sub_page: str | None = None
        self.purchase: PurchaseReward | None = None

    # What the page shows.

    def texts(self) -> list[str]:
        """The page's visible strings, in order."""
        instruction = ["Instruction:", self.goal.instruction]
        if self.page == "search":
            return ["WebShop", *instruction, SEARCH]
        if self.page == "done":
            return ["Thank you for shopping with us!", "Your score (min 0.0, max 1.0)", str(self.purchase.reward)]
        if self.page == "results":
            shown = self._shown()
            texts = [*instruction, BACK_TO_SEARCH, f"Page {self.page_number} (Total results: {len(self.results)})"]
            texts += [PREV_PAGE, NEXT_PAGE] if self.page_number > 1 else [NEXT_PAGE]
            for asin in shown:
                product = self.catalogue.products[asin]
                texts += [asin, product.title, product.price_tag]
            return texts
        product = self.catalogue.products[self.asin]
        if self.page == "item":
            options = [text for name, values in product.options.items() for text in (name, *values)]
            return [*instruction, BACK_TO_SEARCH, PREV_PAGE, *options, product.title, f"Price: {product.price_tag}",
                    "Rating: N.A.", *SUB_PAGES, BUY_NOW]
        content = {"Description": [product.description], "Features": list(product.bullet_points), "Reviews": []}
        return [*instruction, BACK_TO_SEARCH, PREV_PAGE, *content[self.sub_page]]

    def observation(self) -> str:
        """WebShop's 'text' observation: the visible strings, stripped, joined with " [SEP] "."""
        return " [SEP] ".join(text.strip() for text in self.texts() if text.strip())

    def after_instruction(self) -> str:
        """verl-agent's observation and anchor: the strings after the instruction, each quoted."""
        texts = [text.strip() for text in self.texts() if text.strip()]
        if self.goal.instruction in texts:
            texts = texts[texts.index(self.goal.instruction) + 1:]
        return " [SEP] ".join(f"'{text}'" for text in texts)

    def clickables(self) -> list[str]:
        """What `click[...]` takes here, lower case, in WebShop's order (buttons, then product links or options)."""
        if self.page == "search":
            return [SEARCH.lower()]
        if self.page == "done":
            return []
        if self.page == "results":
            buttons = [BACK_TO_SEARCH, PREV_PAGE, NEXT_PAGE] if self.page_number > 1 else [BACK_TO_SEARCH, NEXT_PAGE]
            return [button.lower() for button in buttons] + [asin.lower() for asin in self._shown()]
        if self.page == "item":
            product = self.catalogue.products[self.asin]
            buttons = [BACK_TO_SEARCH, PREV_PAGE, *SUB_PAGES, BUY_NOW]
            values = [value for values in product.options.values() for value in values]
            return [button.lower() for button in buttons] + list(dict.fromkeys(values))
        return [BACK_TO_SEARCH.lower(), PREV_PAGE.lower()]

    def admissible_actions(self) -> list[str]:
        """The actions as verl-agent lists them: `search[<your query>]` where there is a search bar, then a click on
        each clickable."""
        search = [SEARCH_PLACEHOLDER] if self.page == "search" else []
        return search + [f"click[{clickable}]" for clickable in self.clickables()]

    def state(self) -> tuple[Hashable, ...]:
        """The exact page state (the default anchor): what the page shows and where its buttons lead (an item page's
        `< prev` returns to its search's page)."""
        if self.page == "search":
            return ("search",)
        return (self.page, self.keywords, self.page_number, self.asin, tuple(sorted(self.options.items())),
                self.sub_page)

    # What an action does.

    def act(self, action: str) -> str | None:
        """Play one action; returns why it did nothing (an invalid action), or None."""
        match = re.fullmatch(r"\s*(search|click)\[(.+)\]\s*", action, flags=re.DOTALL)
        if match is None:
            return "an action is search[keywords] or click[element]"
        kind, argument = match.group(1), match.group(2).strip().lower()
        if kind == "search":
            if not argument:
                return "the search is empty"
            self.keywords, self.page_number, self.page = argument, 1, "results"
            self.results = self.catalogue.search(argument, self.search_results)
            self.asin, self.options, self.sub_page = None, {}, None
            return None
        if argument == SEARCH.lower() or argument not in self.clickables():
            return f"{argument!r} is not a clickable of this page"
        self._click(argument)
        return None

    def _click(self, element: str) -> None:
        if element == BUY_NOW.lower():
            product = self.catalogue.products[self.asin]
            self.purchase = purchase_reward(product, self.catalogue.prices[self.asin], self.options, self.goal)
            self.page = "done"
        elif element == BACK_TO_SEARCH.lower():
            self.page, self.keywords, self.results, self.asin, self.options, self.sub_page = \
                "search", None, [], None, {}, None
        elif element == NEXT_PAGE.lower():
            self.page_number += 1
        elif element == PREV_PAGE.lower() and self.page == "results":
            self.page_number -= 1
        elif element == PREV_PAGE.lower() and self.page == "sub_page":
            self.page, self.sub_page = "item", None
        elif element == PREV_PAGE.lower():  # from an item page, back to its results page
            self.page, self.asin, self.options = "results", None, {}
        elif element in (page.lower() for page in SUB_PAGES):
            self.page, self.sub_page = "sub_page", next(page for page in SUB_PAGES if page.lower() == element)
        elif self.page == "results":  # a product link
            self.page, self.asin = "item", element.upper()
        else:  # an option value: the last group offering it, as WebShop's radio buttons
            product = self.catalogue.products[self.asin]
            name = [name for name, values in product.options.items() if element in values][-1]
            self.options[name] = element

    def _shown(self) -> list[str]:
        start = (self.page_number - 1) * self.results_per_page
        return self.results[start:start + self.results_per_page]

    def walkthrough(self) -> list[str]:
        """The oracle's actions from the search page: search the instruction, page to the goal's product, click it,
        choose the goal's options (each goal option's value, a synthetic goal's from its pair), buy."""
        keywords = self.goal.instruction.lower()
        results = self.catalogue.search(keywords, self.search_results)
        if self.goal.asin not in results:
            raise ValueError(f"the goal's product {self.goal.asin} is not among the top {self.search_results} results "
                             f"of its instruction: the oracle cannot find it")
        page = results.index(self.goal.asin) // self.results_per_page
        product = self.catalogue.products[self.goal.asin]
        options = []
        for option in self.goal.options:  # the goal's value where the product offers it, else the closest one
            wanted = option[1] if isinstance(option, tuple) else option
            have = [value for values in product.options.values() for value in values]
            best = wanted if wanted in have else max(have, key=lambda value: fuzzy_ratio(value, wanted), default=None)
            if best is not None and best not in options:
                options.append(best)
        return [f"search[{keywords}]", *["click[next >]"] * page, f"click[{self.goal.asin.lower()}]",
                *[f"click[{value}]" for value in options], "click[buy now]"]


# --------------------------------------------------------------------------------------------
# The environment, the TRL class, scripted players.
# --------------------------------------------------------------------------------------------


def _catalogue(settings: ShopSettings, items: str | None, attributes: str | None, human_instructions: str | None,
               human_goals: bool, documents: str | None) -> Catalogue:
    if items is None and documents is None:
        if attributes is not None or human_instructions is not None or human_goals:
            raise ValueError("attributes, human_instructions and human_goals are for WebShop's data: give items "
                             "(items_shuffle*.json) or documents too")
        return generated_catalogue(settings)
    return webshop_catalogue(*(str(path) if path is not None else None for path in (items, attributes, human_instructions)),
                             bool(human_goals), str(documents) if documents is not None else None)


_INSTRUCTION = ("First think step by step inside <think> </think>. Then give exactly one admissible action inside "
                "<action> </action>, e.g. <action>search[white running shoes]</action> or <action>click[buy now]</action>.")
# verl-agent's WebShop prompt in this package's template (the task, the page, the admissible actions, the format).
PROMPT_TEMPLATE = PromptTemplate(
    system="You are an expert autonomous agent operating in the WebShop e-commerce environment.",
    task="Your task is to: {task}.",
    current="Your current observation (step {step}) is: {observation}",
    actions_header="Your admissible actions of the current situation are:",
    instruction=_INSTRUCTION,
    max_action_chars=400,  # a search of a whole instruction, options and price included
)


class WebShopEnv(BaseTextEnv):
    """See the module docstring.

    Args:
        num_products, distractors, options_per_product, shop_seed: the generated shop's knobs (`ShopSettings`).
        items, attributes, human_instructions, human_goals, documents: WebShop's data instead (the module docstring).
        search_results: the hits a search returns (WebShop's 50).
        results_per_page: the hits a results page shows (WebShop's 10).
        anchor: "state" or "observation" (the module docstring).
        reward: "score" (WebShop's reward) or "success" (1.0 for a success, else 0).
        max_steps: the turn limit (15, verl-agent's); None for none.

    `reset(seed)`: the task of that seed (on WebShop's data, the goal of that index). `walkthrough`: the oracle's
    actions; `goal`: the current task's `Goal`.
    """

    def __init__(self, *, num_products: int = 1000, distractors: int = 3, options_per_product: int = 1,
                 shop_seed: int = 0, items: str | None = None, attributes: str | None = None,
                 human_instructions: str | None = None, human_goals: bool = False, documents: str | None = None,
                 search_results: int = SEARCH_RESULTS, results_per_page: int = RESULTS_PER_PAGE,
                 anchor: str = "state", reward: str = "score", max_steps: int | None = 15) -> None:
        super().__init__(max_steps=max_steps)
        for name, value in (("search_results", search_results), ("results_per_page", results_per_page)):
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if anchor not in ANCHORS:
            raise ValueError(f"anchor must be one of {ANCHORS}, got {anchor!r}")
        if reward not in REWARDS:
            raise ValueError(f"reward must be one of {REWARDS}, got {reward!r}")
        self.search_results, self.results_per_page, self.anchor, self.reward = \
            search_results, results_per_page, anchor, reward
        settings = ShopSettings(num_products, distractors, options_per_product, shop_seed)
        self.catalogue = _catalogue(settings, items, attributes, human_instructions, human_goals, documents)
        self._session: _Session | None = None

    @property
    def seed_description(self) -> str:
        count = self.catalogue.num_goals
        return "an int" if count is None else f"a goal index in [0, {count}) of {self.catalogue.source}"

    def seed_in_range(self, seed: int) -> bool:
        return self.catalogue.num_goals is None or 0 <= seed < self.catalogue.num_goals

    def fold_seeds(self, fold: str) -> Sequence[int]:
        """The goal indices of a fold of WebShop's canonical split ("test": the first 500 goals, "dev": the next 1,000,
        "train": the rest); a generated shop's folds are disjoint seed ranges."""
        if self.catalogue.folds is None:
            return default_fold_seeds(fold)
        return self.catalogue.folds[fold]

    @property
    def goal(self) -> Goal:
        self.require_reset("the goal")
        return self._session.goal

    @property
    def walkthrough(self) -> list[str]:
        """The oracle's actions from the start of the current task."""
        self.require_reset("the walkthrough")
        return self._session.walkthrough()

    def _reset(self, seed: int | None, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        if options:
            raise ValueError(f"WebShopEnv's tasks are seeds; it takes no options, got {sorted(options)}")
        if seed is None:
            seed = random.Random().randrange(self.catalogue.num_goals or 2**31)
        self._session = _Session(self.catalogue, self.catalogue.goal_of(seed), self.search_results,
                                 self.results_per_page)
        return self._session.observation(), self._info(None)

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        session = self._session
        invalid = session.act(action)
        done = session.page == "done"
        reward = 0.0
        if done:
            won = session.purchase.reward == 1.0
            reward = session.purchase.reward if self.reward == "score" else float(won)
        return session.observation(), reward, done, self._info(invalid)

    def _info(self, invalid: str | None) -> dict[str, Any]:
        session = self._session
        purchase = session.purchase
        return {
            INFO_ANCHOR: session.state() if self.anchor == "state" else session.after_instruction(),
            INFO_ADMISSIBLE_ACTIONS: session.admissible_actions(),
            INFO_TASK: session.goal.instruction,
            INFO_TASK_TYPE: session.goal.category,
            INFO_WON: purchase is not None and purchase.reward == 1.0,
            INFO_METRICS: {"score": 100.0 * purchase.reward if purchase else 0.0, "purchased": float(purchase is not None)},
            INFO_INVALID_ACTION: invalid,
        }


class WebShopToolEnv:
    """WebShop as a TRL environment class (`GRPOTrainer(environment_factory=...)`, or `GiGPOTrainer`'s): the tasks of
    `WebShopEnv` (built with its knobs and data, e.g. `functools.partial(WebShopToolEnv, options_per_product=0)`), with
    the tools `search` and `click`. `reset(**row)`: the row's `seed` picks the task; TRL's `prompt` and other columns
    are ignored. Each tool call takes a turn; after `max_steps` of them, or a purchase, the episode is `done`.
    `get_reward()` is WebShop's reward of the purchase (0.0 without one); `won` says whether it was 1.0; `anchor` is
    the exact page state."""

    def __init__(self, *, max_steps: int = 15, **knobs: Any) -> None:
        if not is_int(max_steps) or max_steps < 1:
            raise ValueError(f"max_steps must be an int >= 1, got {max_steps!r}")
        self._env = WebShopEnv(max_steps=None, **knobs)
        self._max_steps, self._turns = max_steps, 0
        self.done = self.won = False

    def reset(self, **row: Any) -> str:
        if "seed" not in row:
            raise ValueError(f"WebShopToolEnv.reset needs a `seed` column, got the columns {sorted(row)}")
        observation, _ = self._env.reset(seed=row["seed"])
        self._turns, self.done, self.won = 0, False, False
        return f" {observation}"

    def search(self, keywords: str) -> str:
        """Search the shop.

        Args:
            keywords: What to search for, e.g. the product and the attributes the instruction asks for.

        Returns:
            The results page: the products' ids, titles and prices, with the buttons you can click.
        """
        return self._act(f"search[{keywords}]")

    def click(self, element: str) -> str:
        """Click an element of the current page: a product id on a results page, an option value, "buy now",
        "description", "features", "reviews", "next >", "< prev" or "back to search".

        Args:
            element: The element's text, as the page shows it.

        Returns:
            The page the click leads to.
        """
        return self._act(f"click[{element}]")

    def get_reward(self) -> float:
        purchase = self._env._session.purchase if self._env._session else None
        return purchase.reward if purchase else 0.0

    @property
    def anchor(self) -> Hashable:
        return self._env._session.state()

    def _act(self, action: str) -> str:
        if self.done:
            raise ValueError("The episode is over.")
        self._turns += 1
        observation, _, terminated, _, info = self._env.step(action)
        self.won = bool(info[INFO_WON])
        self.done = terminated or self._turns >= self._max_steps
        if info[INFO_INVALID_ACTION]:
            raise ValueError(f"{info[INFO_INVALID_ACTION]}; the clickables here: {', '.join(self._env._session.clickables())}")
        return observation


def greedy_policy(instruction: str, observation: str, admissible_actions: Sequence[str]) -> str:
    """Search the instruction, click the first result, buy it (no option chosen)."""
    if SEARCH_PLACEHOLDER in admissible_actions:
        return f"search[{instruction.lower()}]"
    if "click[buy now]" in admissible_actions:
        return "click[buy now]"
    products = [action for action in admissible_actions if re.fullmatch(r"click\[b0[0-9a-z]{8}\]", action)]
    return products[0] if products else "click[back to search]"


def play(env: WebShopEnv, seed: int, policy: Callable[[str, str, Sequence[str]], str] | None = None
         ) -> tuple[float, bool, int]:
    """Play task `seed` with `policy(instruction, observation, admissible_actions)` (None: the walkthrough); returns
    the purchase's reward (0 without one), whether it was a success, and the steps taken."""
    observation, info = env.reset(seed=seed)
    actions = iter(env.walkthrough) if policy is None else None
    steps, reward, done = 0, 0.0, False
    while not done:
        action = next(actions) if actions is not None else policy(info[INFO_TASK], observation,
                                                                   info[INFO_ADMISSIBLE_ACTIONS])
        observation, reward, terminated, truncated, info = env.step(action)
        steps, done = steps + 1, terminated or truncated
    purchase = env._session.purchase
    return (purchase.reward if purchase else 0.0), bool(info[INFO_WON]), steps
