"""Per-tenant metric families: one series per tenant, or one summed over the tenants.

``metrics.tenant_labels`` decides (``blockd.metrics_config``). With it off, an exposition names no
tenant: a scraper (or whoever can reach an unauthenticated listener) learns the pool's totals but
not which tenants exist or what each does. The family keeps its name and its other labels, so a
dashboard's ``sum by (tier) (...)`` reads the same either way; only ``by (tenant)`` collapses.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

Family = CounterMetricFamily | GaugeMetricFamily

SUMMED = " Summed over tenants (metrics.tenant_labels is off)."


def tenant_family(kind: type[Family], name: str, doc: str,
                  rows: Iterable[tuple[Sequence[str], float]], *, labels: bool,
                  other: Sequence[str] = ()) -> Family:
    """``kind(name, ...)`` from ``rows`` of ((tenant, *other label values), value): labelled
    ``tenant`` plus ``other`` with ``labels``, else summed per value of ``other`` (one
    unlabelled series when there is none, 0 without tenants)."""
    if labels:
        family = kind(name, doc, labels=["tenant", *other])
        for key, value in rows:
            family.add_metric(list(key), value)
        return family
    sums: dict[tuple[str, ...], float] = {} if other else {(): 0}
    for key, value in rows:
        rest = tuple(key[1:])
        sums[rest] = sums.get(rest, 0) + value
    family = kind(name, doc + SUMMED, labels=list(other))
    for rest in sorted(sums):
        family.add_metric(list(rest), sums[rest])
    return family
