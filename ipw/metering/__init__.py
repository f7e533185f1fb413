"""The measuring core: sensor windows over a set of sensors (``window``), how the energy of overlapping
requests is split (``split``: the priced split over accounting periods, and the time-local one), and the
meter that cuts a span at every request event and gives each request its share (``meter``), shared by
``ipw run`` and ``ipw serve`` (docs/ARCHITECTURE.md, docs/SERVING.md)."""
