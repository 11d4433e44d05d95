"""Query routing: which tier answers a typed question — quick (no model), standard (model), deep (long).

A scikit-learn LinearSVC over character n-gram TF-IDF (`char_wb`, 1–4 grams): no tokenizer, so
Chinese and English queries work alike. It is trained from `deskeye/rules/router_queries.tsv` (one
`tier<TAB>query` per line) on first use — about a second — and cached as a pickle in the user's
cache dir, keyed by a hash of the data file (and the scikit-learn version), so an edited file
retrains and an unchanged one loads at once. Nothing happens at import.

Confidence is the softmax of the three LinearSVC decision values, taken at the chosen tier: a
relative score in (1/3, 1), not a calibrated probability. `router.min_confidence` sends a
quick/deep verdict below it to the standard tier.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import pickle
from dataclasses import dataclass
from pathlib import Path

from deskeye.errors import RouterDataError, UsageError
from deskeye.files import read_regular_text, write_file_atomically
from deskeye.language import detect_lang

log = logging.getLogger(__name__)

TIERS = ("quick", "standard", "deep")
DATA_FILE_NAMES = ("router_queries.tsv", "router_queries.csv")
FEATURES_VERSION = "charwb-1-4-tfidf-linearsvc-v1"   # bump when the pipeline changes: old caches are ignored
NGRAM_RANGE = (1, 4)
SVM_C = 1.0
CV_FOLDS = 5
MAX_DATA_FILE_BYTES = 16 << 20      # the shipped file is 16 KB; a labelled set this big is not one


@dataclass(frozen=True)
class Example:
    tier: str
    query: str
    line: int

    @property
    def lang(self) -> str:
        return detect_lang(self.query)


@dataclass(frozen=True)
class Route:
    tier: str              # "quick" | "standard" | "deep"
    confidence: float      # softmax of the decision values at `tier` (see module docstring)
    fell_back: bool = False  # True when a low-confidence quick/deep verdict was sent to standard


# ---------------------------------------------------------------- data

def find_data_file(rules_dir: Path) -> Path:
    for name in DATA_FILE_NAMES:
        if (rules_dir / name).is_file():
            return rules_dir / name
    raise RouterDataError(f"No router data in {rules_dir}: expected {' or '.join(DATA_FILE_NAMES)} "
                          "(one 'tier<TAB>query' per line after a header). Set router.data_dir in settings.")


def load_examples(path: Path) -> list[Example]:
    """Read `tier<TAB>query` lines (a `.csv` uses commas); the first line is the header."""
    sep = "," if path.suffix == ".csv" else "\t"
    lines = read_data(path).splitlines()
    examples = [_parse_line(path, number, text, sep) for number, text in enumerate(lines[1:], start=2)
                if text.strip() and not text.startswith("#")]
    missing = [t for t in TIERS if not any(e.tier == t for e in examples)]
    if missing:
        raise RouterDataError(f"{path}: no examples for tier(s) {', '.join(missing)}; each tier needs some.")
    return examples


def read_data(path: Path) -> str:
    """The data file's text: a regular UTF-8 file of at most MAX_DATA_FILE_BYTES, else RouterDataError."""
    try:
        return read_regular_text(path, max_bytes=MAX_DATA_FILE_BYTES, what="router data file", error=RouterDataError)
    except FileNotFoundError:
        raise RouterDataError(f"{path}: the router data file is gone; set router.data_dir in settings.") from None


def _parse_line(path: Path, number: int, text: str, sep: str) -> Example:
    tier, found, query = text.partition(sep)
    tier, query = tier.strip(), query.strip()
    if not found or not query:
        raise RouterDataError(f"{path}, line {number}: expected 'tier{sep!r}query', got {text!r}.")
    if tier not in TIERS:
        raise RouterDataError(f"{path}, line {number}: unknown tier {tier!r}; use one of {', '.join(TIERS)}.")
    return Example(tier, query, number)


# ---------------------------------------------------------------- model

def build_pipeline():
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.pipeline import make_pipeline
    from sklearn.svm import LinearSVC
    return make_pipeline(
        TfidfVectorizer(analyzer="char_wb", ngram_range=NGRAM_RANGE, sublinear_tf=True, lowercase=True),
        LinearSVC(C=SVM_C),
    )


def train_pipeline(examples: list[Example]):
    pipeline = build_pipeline()
    pipeline.fit([e.query for e in examples], [e.tier for e in examples])
    return pipeline


class Router:
    def __init__(self, pipeline, *, min_confidence: float = 0.0):
        self._pipeline = pipeline
        self.min_confidence = min_confidence

    @classmethod
    def from_examples(cls, examples: list[Example], *, min_confidence: float = 0.0) -> "Router":
        return cls(train_pipeline(examples), min_confidence=min_confidence)

    @classmethod
    def load(cls, settings, *, cache_dir: Path | None = None) -> "Router":
        """The router for settings.rules_dir's data: from the cache if the data is unchanged, else trained."""
        path = find_data_file(settings.rules_dir)
        data = read_data(path).encode("utf-8")
        cache_path = (cache_dir or default_cache_dir()) / f"router-{cache_key(data)}.pkl"
        pipeline = _read_cache(cache_path)
        if pipeline is None:
            pipeline = train_pipeline(load_examples(path))
            _write_cache(cache_path, pipeline)
        return cls(pipeline, min_confidence=settings.router.min_confidence)

    def route(self, query: str) -> Route:
        """The tier for one query. An empty query goes to standard with confidence 0."""
        if not query.strip():
            return Route("standard", 0.0)
        scores = self._pipeline.decision_function([query])[0]
        classes = list(self._pipeline.classes_)
        best = max(range(len(classes)), key=lambda i: scores[i])
        confidence = _softmax(scores)[best]
        tier = str(classes[best])
        if tier != "standard" and confidence < self.min_confidence:
            return Route("standard", confidence, fell_back=True)
        return Route(tier, confidence)


def _softmax(scores) -> list[float]:
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    total = sum(exps)
    return [e / total for e in exps]


# ---------------------------------------------------------------- cache

def default_cache_dir() -> Path:
    import platformdirs
    return Path(platformdirs.user_cache_dir("deskeye", appauthor=False))


def cache_key(data: bytes) -> str:
    import sklearn
    digest = hashlib.sha256(data)
    digest.update(f"|{FEATURES_VERSION}|sklearn={sklearn.__version__}".encode())
    return digest.hexdigest()[:20]


def _read_cache(path: Path):
    if not path.is_file():
        return None
    try:
        with path.open("rb") as f:
            return pickle.load(f)   # our own file in the user's cache dir, keyed by the data hash
    except Exception as exc:  # noqa: BLE001 - a stale or broken cache is simply retrained
        log.info("router cache %s unusable (%s); retraining", path, exc)
        return None


def _write_cache(path: Path, pipeline) -> None:
    """Cache the trained pipeline atomically (a full disk leaves no partial or temp file), then drop older caches."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomically(path, pickle.dumps(pipeline, protocol=pickle.HIGHEST_PROTOCOL))
        for old in path.parent.glob("router-*.pkl"):
            if old != path:
                old.unlink(missing_ok=True)
    except (OSError, pickle.PicklingError) as exc:
        log.warning("could not cache the router in %s (%s); it will be retrained next time", path.parent, exc)


# ---------------------------------------------------------------- evaluation

@dataclass(frozen=True)
class Score:
    num_correct: int
    num_total: int

    @property
    def accuracy(self) -> float:
        return self.num_correct / self.num_total if self.num_total else 0.0


def score_predictions(examples: list[Example], predicted: list[str]) -> dict[str, Score]:
    """Accuracy per tier, per language ("lang:en", "lang:zh") and "overall"."""
    groups: dict[str, list[bool]] = {}
    for example, tier in zip(examples, predicted):
        is_right = example.tier == tier
        for key in (example.tier, f"lang:{example.lang}", "overall"):
            groups.setdefault(key, []).append(is_right)
    return {key: Score(sum(hits), len(hits)) for key, hits in groups.items()}


def cross_validate(examples: list[Example], *, folds: int = CV_FOLDS, seed: int = 0) -> dict[str, Score]:
    """Stratified k-fold (by tier and language): every query is predicted by a model that never saw it."""
    from sklearn.model_selection import StratifiedKFold, cross_val_predict
    queries = [e.query for e in examples]
    tiers = [e.tier for e in examples]
    strata = [f"{e.tier}/{e.lang}" for e in examples]
    splits = StratifiedKFold(folds, shuffle=True, random_state=seed).split(queries, strata)
    predicted = cross_val_predict(build_pipeline(), queries, tiers, cv=list(splits))
    return score_predictions(examples, [str(p) for p in predicted])


# ---------------------------------------------------------------- CLI

def cmd_route(args, settings) -> int:
    """`deskeye route QUERY...` (one line each; --json: one JSON object per line) or `--evaluate`."""
    if args.evaluate:
        return _print_evaluation(settings, as_json=args.json)
    if not args.queries:
        raise UsageError("give at least one QUERY (e.g. deskeye route \"what time is it\"), or --evaluate.")
    router = Router.load(settings)
    for query in args.queries:
        route = router.route(query)
        if args.json:
            print(json.dumps({"query": query, "tier": route.tier, "confidence": round(route.confidence, 4)},
                             ensure_ascii=False))
        else:
            print(f"{route.tier:<8} {route.confidence:.2f}  {query}")
    return 0


def _print_evaluation(settings, *, as_json: bool) -> int:
    path = find_data_file(settings.rules_dir)
    examples = load_examples(path)
    scores = cross_validate(examples)
    keys = [*TIERS, *sorted(k for k in scores if k.startswith("lang:")), "overall"]
    if as_json:
        print(json.dumps({k: {"accuracy": round(scores[k].accuracy, 4), "n": scores[k].num_total}
                          for k in keys if k in scores}))
        return 0
    print(f"router: {len(examples)} labelled queries from {path}, {CV_FOLDS}-fold cross-validation")
    print(f"{'group':<10} {'n':>5}  accuracy")
    for key in keys:
        if key in scores:
            print(f"{key:<10} {scores[key].num_total:>5}  {scores[key].accuracy:.3f}")
    return 0
