"""Research quality, offline: does the report cite the pages that answer the question?

    DATABASE_URL=postgres://longhaul:longhaul@127.0.0.1:5432/longhaul_bench \\
        .venv/bin/python bench/research_quality.py [--questions 36]

Each question of bench/research_questions.py (written from the Python documentation, each with
the pages a good answer cites) is submitted as a real `research` task and run to its end by the
runtime in this process (steps and gateway batches, as the integration tests do), with the
offline provider and the offline corpus. For each report:

    hit        it cites at least one of the question's pages              (target: >= 90% of questions)
    precision  the share of its cited sources that are among those pages  (target: >= 80% of citations)

"Cited" is a source the report's text refers to as [n]; a page is the documentation's HTML page
(library/filecmp.html), whichever section of it is cited. Also reported: the report's length and
the time from submit to the finished report. The baseline, in the same run, is the same pipeline
on the fallback corpus (pydoc's topics and docstrings, what the product answered from before);
its module documents map to library/<module>.html, its topics to no page. The held-out questions
(research_questions.HELD_OUT, written after the thresholds were tuned) are reported beside them,
not judged.
Every row made is deleted at the end.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import _harness as h
from django.test import override_settings
from research_questions import HELD_OUT, QUESTIONS, Question

from tasks import actions, jobs, operations
from tasks.gateway import corpus
from tasks.models import Task
from tasks.statuses import TaskStatus

TARGET_HIT, TARGET_PRECISION = 0.90, 0.80
DOCS_ROOT = Path("/usr/share/doc/python3.11/html")
CITATION = re.compile(r"(?<!\\)\[(\d+)\]")
ENDED = (TaskStatus.SUCCEEDED, TaskStatus.FAILED, TaskStatus.PARTIAL, TaskStatus.CANCELLED)


@dataclass
class Outcome:
    question: Question
    status: str
    pages: list[str]  # cited, in citation order, one per source
    words: int
    seconds: float

    @property
    def good(self) -> int:
        return sum(page in self.question.pages for page in self.pages)

    @property
    def hit(self) -> bool:
        return self.good > 0


def page_of(url: str) -> str:
    """The documentation page a corpus URL stands for ("" when none)."""
    if url.startswith(corpus.DOCS_PREFIX):
        return url[len(corpus.DOCS_PREFIX):].split("#", 1)[0]
    if url.startswith("corpus://module/"):
        parts = url[len("corpus://module/"):].split(".")
        for end in range(len(parts), 0, -1):
            candidate = "library/" + ".".join(parts[:end]) + ".html"
            if (DOCS_ROOT / candidate).exists():
                return candidate
    return ""


def run_to_end(task: Task, *, max_rounds: int = 80) -> Task:
    for _ in range(max_rounds):
        task.refresh_from_db()
        if task.status in ENDED:
            return task
        if task.current_step and operations.unfinished(task.pk, task.current_step - 1):
            operations.run_due(run_for=5)
        else:
            jobs.advance(task.pk)
    raise RuntimeError(f"task {task.pk} still {task.status} after {max_rounds} rounds")


def ask(scope: h.Scope, question: Question) -> Outcome:
    started = time.monotonic()
    task, _ = actions.submit(tenant=scope.tenant, user=scope.user, submission=actions.Submission(
        kind="research", input={"question": question.text}))
    task = run_to_end(task)
    seconds = time.monotonic() - started
    result = task.result or {}
    report = str(result.get("report", ""))
    body = report.split("\n## Sources\n", 1)[0]
    by_n = {s["n"]: s["url"] for s in result.get("sources", [])}
    cited = list(dict.fromkeys(int(n) for n in CITATION.findall(body) if int(n) in by_n))
    return Outcome(question, task.status, [page_of(by_n[n]) for n in cited], len(body.split()), seconds)


def run_corpus(scope: h.Scope, questions: list[Question], *, docs: str, index: Path) -> list[Outcome]:
    with override_settings(LONGHAUL_DOCS_PATH=docs, LONGHAUL_CORPUS_PATH=str(index), LONGHAUL_SEARCH_URL="",
                           LONGHAUL_MODEL_PROVIDER="offline", LONGHAUL_STEP_SLICE_MS=0):
        corpus.ensure_index()
        return [ask(scope, question) for question in questions]


def figures(outcomes: list[Outcome]) -> dict[str, float]:
    cited = sum(len(o.pages) for o in outcomes)
    return {
        "hit": sum(o.hit for o in outcomes) / len(outcomes),
        "precision": sum(o.good for o in outcomes) / cited if cited else 0.0,
        "citations": cited / len(outcomes),
        "words": h.median(o.words for o in outcomes),
        "seconds p50": h.percentile([o.seconds for o in outcomes], 50),
        "seconds p90": h.percentile([o.seconds for o in outcomes], 90),
        "finished": sum(o.status == TaskStatus.SUCCEEDED for o in outcomes) / len(outcomes),
    }


def run(*, questions: int = len(QUESTIONS)) -> h.Report:
    chosen = list(QUESTIONS[:questions])
    report = h.Report("research_quality", "Research quality: reports that cite the pages that answer",
                      f"{len(chosen)} questions of bench/research_questions.py, each a real `research` task run to "
                      "its end in this process with the offline provider; the baseline is the same pipeline on "
                      "the pydoc fallback corpus.")
    if not DOCS_ROOT.joinpath("library", "index.html").exists():
        report.notes.append(f"the Python documentation is not installed under {DOCS_ROOT}: run bin/ensure-pydocs.")
        report.targets.append(h.Target("the documentation corpus is installed", "missing", False))
        return report
    scope = h.Scope.create("research")
    try:
        with tempfile.TemporaryDirectory(prefix="bench-research-") as tmp:
            docs = run_corpus(scope, chosen, docs=str(DOCS_ROOT), index=Path(tmp) / "docs.sqlite3")
            held = run_corpus(scope, list(HELD_OUT), docs=str(DOCS_ROOT), index=Path(tmp) / "docs.sqlite3")
            pydoc = run_corpus(scope, chosen, docs=str(Path(tmp) / "no-docs"), index=Path(tmp) / "pydoc.sqlite3")
    finally:
        scope.purge()
    ours, base, unseen = figures(docs), figures(pydoc), figures(held)

    def pct(value: float) -> str:
        return f"{100 * value:.0f}%"

    report.add("Summary", h.table(["corpus", "questions hit", "citations on the pages", "citations per report",
                                   "report words (median)", "seconds per report p50", "p90", "succeeded"], [
        ["Python 3.11 documentation (python3.11-doc)", pct(ours["hit"]), pct(ours["precision"]),
         h.fmt(ours["citations"]), f"{ours['words']:.0f}", h.fmt(ours["seconds p50"], 2),
         h.fmt(ours["seconds p90"], 2), pct(ours["finished"])],
        ["baseline: pydoc topics and docstrings", pct(base["hit"]), pct(base["precision"]),
         h.fmt(base["citations"]), f"{base['words']:.0f}", h.fmt(base["seconds p50"], 2),
         h.fmt(base["seconds p90"], 2), pct(base["finished"])],
        [f"held out: {len(HELD_OUT)} questions written after tuning (documentation)", pct(unseen["hit"]),
         pct(unseen["precision"]), h.fmt(unseen["citations"]), f"{unseen['words']:.0f}",
         h.fmt(unseen["seconds p50"], 2), h.fmt(unseen["seconds p90"], 2), pct(unseen["finished"])],
    ]))
    report.add("Per question (held out)", h.table(["question", "hit", "cited pages"], [
        [o.question.text, "yes" if o.hit else "**no**",
         ", ".join(("" if p in o.question.pages else "✗ ") + (p or "(no page)") for p in o.pages) or "(none)"]
        for o in held]))
    report.add("Per question (documentation corpus)", h.table(["question", "hit", "cited pages", "words", "s"], [
        [o.question.text, "yes" if o.hit else "**no**",
         ", ".join(("" if p in o.question.pages else "✗ ") + (p or "(no page)") for p in o.pages) or "(none)",
         str(o.words), h.fmt(o.seconds, 2)]
        for o in docs]))
    report.targets.append(h.Target("reports citing at least one expected page >= 90%",
                                   f"{pct(ours['hit'])} (baseline {pct(base['hit'])})",
                                   ours["hit"] >= TARGET_HIT))
    report.targets.append(h.Target("citations among the expected pages >= 80%",
                                   f"{pct(ours['precision'])} (baseline {pct(base['precision'])})",
                                   ours["precision"] >= TARGET_PRECISION))
    report.notes.append(f"The ranking's thresholds were tuned on the {len(chosen)} questions; the "
                        f"{len(HELD_OUT)} held-out questions were written afterwards and never used to tune "
                        f"them: {pct(unseen['hit'])} of them hit and {pct(unseen['precision'])} of their citations "
                        "are on their pages, which is what to expect of questions the ranking has not seen.")
    report.notes.append("Seconds are submit to finished report with every step and call run in this process, "
                        "back to back (no queue, no worker hand-off): the research work itself.")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=len(QUESTIONS))
    args = parser.parse_args()
    if not 1 <= args.questions <= len(QUESTIONS):
        parser.error(f"--questions must be between 1 and {len(QUESTIONS)}")
    h.migrate_if_needed()
    report = run(questions=args.questions)
    print()
    print(report.markdown())


if __name__ == "__main__":
    main()
