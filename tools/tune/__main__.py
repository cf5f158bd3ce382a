from tools.tune.tune import main

raise SystemExit(main())
