"""Fan-out across hosts: one transfer per host for a large publish, passed on by relays
(:mod:`.relays`), which forward a frame while its body still arrives (:mod:`.cut_through`)."""
