// Build for the agent service, which serves dist/ at "/" (`make web` runs it; dist/ is not
// committed). Asset names carry no content hash: the pages and tests name assets/app.js.
import { defineConfig } from "vite";

// `npm run dev` proxies the APIs to a running stack (default: the agent on :8000).
const agent = process.env.TANDEM_AGENT_URL ?? "http://127.0.0.1:8000";

export default defineConfig({
  base: "./",
  build: {
    outDir: "dist",
    emptyOutDir: true,
    target: "es2022",
    sourcemap: false,
    rollupOptions: {
      output: {
        entryFileNames: "assets/app.js",
        chunkFileNames: "assets/[name].js",
        assetFileNames: "assets/[name][extname]",
      },
    },
  },
  server: {
    proxy: {
      "/v1": { target: agent, ws: true },
      "/api": { target: agent },
    },
  },
});
