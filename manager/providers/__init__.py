"""Where VMs come from: the provider interface (:mod:`manager.providers.base`) and its
implementations, local pretend VMs (:mod:`manager.providers.local`) and Azure spot scale sets
(:mod:`manager.providers.azure`)."""
