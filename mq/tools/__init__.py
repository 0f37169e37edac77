"""Tools that ship with mq but are not the library: the benchmark (:mod:`mq.tools.bench`), its
network-namespace helper (:mod:`mq.tools.netns`) and the demo job (:mod:`mq.tools.demo`).
Nothing in :mod:`mq` imports from here."""
