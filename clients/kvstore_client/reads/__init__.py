"""Reads: the read path of ``get_into``/``get_many_into`` (:mod:`.path`, the
order; :mod:`.base`, the interface; one module per transport), ``get`` over
HTTP (:mod:`.http`) and ``get_many`` over ``/v1/batch/get`` (:mod:`.batch`)."""
