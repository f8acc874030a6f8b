"""Every page: the admin console, the tenant portal and the alert pages, their forms, their
scoping base classes (`ui_app.scoping`), template tags and URLs. The top floor: nothing
imports it but the root URLs."""
