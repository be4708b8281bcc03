// The docs page: Swagger UI (from the flask-swagger-ui package, served by us) on the served
// document. Kept out of docs.html so the page's Content-Security-Policy can forbid inline script.
"use strict";

window.addEventListener("load", async () => {
  // The page is /v1/docs, so "." is the API's base URL on the server that serves this page.
  const base = new URL(".", window.location.href).href.replace(/\/$/, "");
  const response = await fetch("openapi.json");
  const spec = await response.json();
  // "Try it out" goes to the server that served the page (it may have no other network);
  // the document's own servers stay listed after it.
  spec.servers = [{ url: base, description: "This server" }, ...(spec.servers || [])];
  window.ui = SwaggerUIBundle({
    spec,
    dom_id: "#swagger-ui",
    deepLinking: true,
    presets: [SwaggerUIBundle.presets.apis],
    layout: "BaseLayout",
    // Swagger UI would otherwise send the document to validator.swagger.io.
    validatorUrl: null,
  });
});
