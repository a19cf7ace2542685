"""Quality of generated text: ROUGE against a reference, and whether a code completion parses."""

from __future__ import annotations

import ast

from selfspec.extras import require

_scorer = None


def rouge(reference: str, text: str) -> dict:
    global _scorer
    if _scorer is None:
        require("ROUGE", "rouge_score")
        from rouge_score import rouge_scorer  # the bench extra, slow to import: only runs with references pay it
        _scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    s = _scorer.score(reference, text)
    return {k: s[k].fmeasure for k in ("rouge1", "rouge2", "rougeL")}


def _function_end(prompt: str, completion: str) -> str:
    """The completion up to where the prompt's function ends: the first non-blank line
    indented no deeper than the prompt's last `def` (HumanEval-style stop)."""
    indent = 0
    for line in prompt.splitlines():
        if line.lstrip().startswith(("def ", "async def ")):
            indent = len(line) - len(line.lstrip())
    text = prompt + completion
    start = len(prompt)
    lines = text[start:].split("\n")
    out = []
    for i, line in enumerate(lines):
        # the first piece continues the prompt's last line; later ones are whole lines
        if i > 0 and line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        out.append(line)
    return "\n".join(out)


def code_parses(prompt: str, completion: str, truncated: bool) -> bool:
    """Does prompt + completion parse as Python? The completion is cut where the function
    ends; when the token budget cut the output, its last, unfinished line is dropped."""
    body = _function_end(prompt, completion)
    candidates = [body]
    if truncated and "\n" in body.rstrip("\n"):
        candidates.append(body.rstrip("\n").rsplit("\n", 1)[0])
    for c in candidates:
        try:
            ast.parse(prompt + c + "\n")
            return True
        except (SyntaxError, ValueError):
            continue
    return False
