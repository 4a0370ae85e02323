"""Each word of docs/architecture.md's "Words" has one meaning in the code: the classes named
with it are the ones the glossary names, and the names retired when a word had two meanings do
not come back."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import hybridserve

PACKAGE = Path(hybridserve.__file__).parent

# word in a class name -> the only classes it may name (a cache group spec lives in its module).
CLASS_WORDS = {
    "Budget": {"AdaptiveBudget"},  # tokens a step may schedule
    "Plan": {"StepPlan"},  # what the scheduler hands the executor
    "Policy": {"SchedulingPolicy"},  # the waiting-queue order
    "Profile": {"ModelProfile"},  # the shape of a model the cost model reads
}
# Names a word's second meaning had; the meaning they named has its own word now.
RETIRED = {
    "GpuSpec": "Gpu",
    "SpecMethod": "SpeculativeMethod",
    "parse_spec": "parse_speculation",
    "spec_token_ids": "draft_token_ids",
    "num_tokens_with_spec": "num_tokens_with_drafts",
    "KvBudget": "MemoryAccount",
    "vllm_kv_budget": "vllm_memory_account",
    "pool_budget": "pool_memory_account",
    "RetentionPolicy": "Retention",
    "PrefillPlan": "PrefillDecision",
}


def _defined_names() -> dict[str, set[str]]:
    """Every class, function, argument and assigned name in the package -> the modules."""
    names: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        module = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                found = [node.name]
            elif isinstance(node, ast.arg):
                found = [node.arg]
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                found = [node.id]
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                found = [node.attr]
            else:
                continue
            for name in found:
                names.setdefault(name, set()).add(module)
    return names


def _classes() -> dict[str, set[str]]:
    classes: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        module = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, set()).add(module)
    return classes


def test_a_glossary_word_names_only_the_classes_of_its_one_meaning() -> None:
    classes = _classes()
    for word, allowed in CLASS_WORDS.items():
        named = {name for name in classes if word in name}
        assert named == allowed, (word, sorted(named - allowed))


def test_spec_in_a_class_name_is_a_cache_group_spec() -> None:
    # Spec as a word of the name: FooSpec, SpecFoo; not Speculative or Special.
    specs = {
        name: modules for name, modules in _classes().items() if re.search(r"Spec(?![a-z])", name)
    }
    assert specs and all(modules == {"kvcache/spec.py"} for modules in specs.values()), specs


def test_the_names_of_a_words_second_meaning_stay_retired() -> None:
    names = _defined_names()
    back = {old: (new, sorted(names[old])) for old, new in RETIRED.items() if old in names}
    assert not back, back
