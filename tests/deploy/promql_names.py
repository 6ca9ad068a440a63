"""Metric names in PromQL expressions, and the series names a Prometheus scrape exposes.

Two halves of one check: every metric a dashboard panel or an alert rule queries must be a series
the daemon actually exports, spelled the way Prometheus stores it.

``exposed_series`` maps each series name Prometheus would store from a text exposition to its
metric family and type. The suffixes are derived from the family's TYPE, never guessed from the
name: a counter family ``x`` is stored as ``x_total`` (``x`` alone does not exist), a histogram
``h`` as ``h_bucket``/``h_sum``/``h_count`` (``h`` alone does not exist), and a *gauge* that
happens to be called ``x_total`` keeps its name (it is not a counter ``x``; blockd has none since
``promtool check metrics`` rejects them). Families declared without samples (a labelled counter
nothing has incremented yet) still count. Names with a colon (``blockd:...:ratio``) are recording
rules, never exported by a daemon.
"""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

#: Series suffixes per metric type (OpenMetrics types as prometheus_client parses them).
SUFFIXES: dict[str, tuple[str, ...]] = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}


def exposed_series(text: str) -> dict[str, tuple[str, str]]:
    """series name -> (family name, type) for a Prometheus text exposition."""
    out: dict[str, tuple[str, str]] = {}
    for family in text_string_to_metric_families(text):
        for suffix in SUFFIXES.get(family.type, ("",)):
            out[family.name + suffix] = (family.name, family.type)
        for sample in family.samples:
            out[sample.name] = (family.name, family.type)
    return out


# -- PromQL -------------------------------------------------------------------------------------

KEYWORDS = frozenset({
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "offset", "bool", "inf", "nan", "start", "end",
})
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_BRACES = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(
    r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.IGNORECASE)
_LABEL_VALUES = re.compile(r"\blabel_values\s*\(\s*([^,()]+?)\s*(?:,\s*[A-Za-z_]\w*\s*)?\)")
_IDENT = re.compile(r"(?<![\w$.:])[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """Metric names selected by a PromQL expression (also Grafana's ``label_values(m, label)``).

    Function names, keywords, label names (in ``{...}`` and grouping clauses), durations,
    numbers and Grafana variables (``$pod``, ``${x}``, ``$__rate_interval``) are not names.
    """
    text = _STRING.sub('""', expr)
    text = re.sub(r"\$\{[^}]*\}", "$v", text)
    text = _BRACES.sub(" ", text)
    text = _LABEL_VALUES.sub(r"\1", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for match in _IDENT.finditer(text):
        word = match.group(0)
        rest = text[match.end():]
        if word.lower() in KEYWORDS or re.match(r"\s*\(", rest):
            continue
        names.add(word)
    return names


def substitute_grafana(expr: str, rate_interval: str = "1m") -> str:
    """A Grafana panel query as plain PromQL: variables as match-all regexes, intervals fixed."""
    expr = expr.replace("$__rate_interval", rate_interval).replace("$__interval", rate_interval)
    expr = expr.replace("${__rate_interval}", rate_interval)
    return re.sub(r"\$\{?[A-Za-z_]\w*\}?", ".*", expr)
