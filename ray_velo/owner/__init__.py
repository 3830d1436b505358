"""The owner side: the pure state of an agent's slots and buffers (:mod:`.state`) and the
seven ``_rv_*`` handlers over it (:mod:`.service`)."""
