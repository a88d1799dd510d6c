"""The run room: a run's session (:mod:`~aitrainsai.run.session`: the loaded plugins and the family objects), the
outer loop (:mod:`~aitrainsai.run.loop`), one episode (:mod:`~aitrainsai.run.episode`) and the ledger every record of a
run is written to and resumed from (:mod:`~aitrainsai.run.ledger`)."""
