"""mq under other frameworks' own launchers. Each integration is a module that imports its
framework: import the one you need (``import mq.integrations.ding``); importing this package
imports no framework."""
