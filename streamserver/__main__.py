from streamserver.cli import main

raise SystemExit(main())
