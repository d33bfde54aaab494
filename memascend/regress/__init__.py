"""The regression suite behind ``memascend regress``: named matrices of configurations
(:mod:`~memascend.regress.matrix`), each run with stock DeepSpeed and with memascend in its own
process (:mod:`~memascend.regress.runner`, under a memory cap through :mod:`memascend.host.memcap`),
compared in the same run and against the golden results of the hardware profile
(:mod:`~memascend.regress.compare`, :mod:`~memascend.regress.golden`), written as JSON, markdown and
plots (:mod:`~memascend.regress.output`); :func:`memascend.regress.session.run_regress` ties them together."""
