"""What a config value interpolates, decided by OmegaConf's own grammar on the parsed value (after YAML
has turned ``\\x24`` into ``$``), never by a pattern on the text; and a scope in which OmegaConf has no
resolvers at all, so that ``${oc.env:...}`` cannot read the environment however it is spelled.

A config is data: a reference to another key (``${output_dir}/cache``) is data too and resolves to
that key's value; a resolver call (``${oc.env:HF_TOKEN}``, ``${oc.${key}:VAR}``) is refused by name, and
one that got past every check would still find no resolver to call.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator, List, Optional, Tuple

from omegaconf import grammar_parser
from omegaconf.basecontainer import BaseContainer
from omegaconf.errors import GrammarParseError
from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser

_NO_RESOLVERS = threading.RLock()  # the registry is global: one scope at a time, so each restores the real one


@contextmanager
def no_resolvers() -> Iterator[None]:
    """OmegaConf with an empty resolver registry while the block runs (``oc.env``, ``oc.decode``, and any
    a library registered): resolving a resolver call fails with OmegaConf's "Unsupported interpolation
    type" instead of running it. The registry is OmegaConf's private ``BaseContainer._resolvers``
    (omegaconf 2.3-2.4; tests/test_config.py checks the scope still empties it)."""
    with _NO_RESOLVERS:
        saved = BaseContainer._resolvers
        BaseContainer._resolvers = {}
        try:
            yield
        finally:
            BaseContainer._resolvers = saved


def _tree(value: str) -> Optional[OmegaConfGrammarParser.ConfigValueContext]:
    """The parse tree OmegaConf builds for ``value`` when it resolves it; None when it does not parse."""
    try:
        return grammar_parser.parse(value, parser_rule="configValue", lexer_mode="DEFAULT_MODE")
    except GrammarParseError:
        return None


def _nodes(tree: Any) -> Iterator[Any]:
    yield tree
    for child in getattr(tree, "children", None) or ():
        yield from _nodes(child)


def interpolations(value: str) -> Tuple[List[str], bool]:
    """The resolvers ``value`` calls (by name as written, nested calls included) and whether it holds
    any interpolation at all (a key reference counts). A value with ``${`` that OmegaConf cannot parse
    counts as a call of ``'?'``: OmegaConf would refuse it too, and a check must not let it pass."""
    if "${" not in value:
        return [], False
    tree = _tree(value)
    if tree is None:
        return ["?"], True
    nodes = list(_nodes(tree))
    calls = [node.resolverName().getText() for node in nodes
             if isinstance(node, OmegaConfGrammarParser.InterpolationResolverContext)]
    found = any(isinstance(node, OmegaConfGrammarParser.InterpolationContext) for node in nodes)
    return calls, found


def strings(data: Any, key: str = "") -> Iterator[Tuple[str, str]]:
    """Every string in ``data`` (plain containers, as parsed) with its key as the messages write it
    (``validation.prompts[1]``); a mapping's keys are yielded too, as values of their own key."""
    if isinstance(data, dict):
        for name, value in data.items():
            full = f"{key}.{name}" if key else str(name)
            if isinstance(name, str):
                yield full, name
            yield from strings(value, full)
    elif isinstance(data, list):
        for index, value in enumerate(data):
            yield from strings(value, f"{key}[{index}]")
    elif isinstance(data, str):
        yield key, data
