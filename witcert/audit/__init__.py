"""The request audit (registry AU): a per-request statement from a few randomly picked cells.

``witcert.monitor(model, scheme, audit=witcert.Audit(rate=0.02, tau=0.2, delta=1e-3))`` picks each
(request, layer, query head, step) cell independently with probability ``rate``, with the monitor's
own secret randomness, bounds each (by default its true TV from every exact key it sees; with ``keys``, the
deterministic meter where it certifies, else a spot check), and ``mon.audit()`` states per request: with
probability at least ``1 - delta``, at most ``M_upper`` of its ``N`` cells have attention TV above ``tau``.

A leaf: torch, numpy, scipy and the spot check; no transformers (a serving integration calls it).

=========================  ===============================================================
``settings``               :class:`Audit`, the split of ``delta``
``picks``                  which cells are picked (Philox, keyed by the cell's identity)
``cells``                  scattered cells gathered into one metering pass
``exact``                  a picked cell's true TV from its exact keys (the default bound)
``budget``                 each picked cell's spot-check ``delta_c``, per step
``bounding``               bound and flag the picked cells; the spot-check adapter
``request``                one request's audit while it runs
``limit``                  the exact binomial upper limit and the interval
``report``                 per-request results from the cell columns
=========================  ===============================================================
"""
from witcert.audit.limit import flagged_interval, upper_limit
from witcert.audit.counts import requests_of
from witcert.audit.report import RequestAudit
from witcert.audit.request import AuditedRequest
from witcert.audit.settings import Audit

__all__ = ["Audit", "AuditedRequest", "RequestAudit", "flagged_interval", "requests_of", "upper_limit"]
